"""torch's thread count kept equal to the cores the engine may run on.

Why: ``serve`` moves engines between cores while it runs (all of the host's while no job trains, part of them
while one does: ``server/core_share.py``), by pinning the engine process from outside. More threads than
cores makes every parallel op wait for a descheduled worker; fewer leaves cores idle. The scheduler thread,
which runs all of the engine's torch work, checks its own affinity before each step (one syscall) and resizes
torch's pool when it changed. A fixed ``--num-threads`` turns this off.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


class ThreadsFollowCores:
    """Call ``follow()`` on the thread that runs torch, before each step."""

    def __init__(self, fixed: int = 0) -> None:
        self.fixed = fixed
        self.cores: frozenset[int] = frozenset()
        self.threads = 0  # what the scheduler thread set (torch's count is per thread: others read this)
        self.follow()

    def follow(self) -> int:
        """Resize torch's pool to this thread's cores if they changed; the thread count now."""
        if self.fixed:
            if self.threads != self.fixed:
                torch.set_num_threads(self.fixed)
                self.threads = self.fixed
            return self.fixed
        cores = frozenset(os.sched_getaffinity(0))
        if cores != self.cores:
            self.cores = cores
            torch.set_num_threads(len(cores))
            self.threads = len(cores)
            log.info("torch threads: %d (cores %s)", len(cores), ",".join(map(str, sorted(cores))))
        return self.threads
