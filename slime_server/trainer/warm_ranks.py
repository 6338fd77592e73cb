"""A finished job's trainer rank processes, kept idle a while for the next job of the same shape.

Why: a rank's process start is mostly imports (torch, Megatron-core, transformers, torch's compiler through its
optimizers): about 5 CPU-seconds on a 2-core CPU host, before anything is trained, and every job paid them again.
A group whose job ended cleanly hands its processes here (each has released its model, optimizer and buffers:
``TrainerRank.shutdown``); the next group with the same world size and Ray placement takes them and sets them up
for its own job (``TrainerRank.reuse``: as a fresh process starts, the job's settings, torch's default seed,
threads and cores). A group of another shape, the server's end or ``keep_s`` idle seconds stop them.

At most one group waits: each holds the Ray resources its ranks reserved (a job of another shape would wait for
them), and on GPU each rank its device's CUDA context.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger(__name__)


class WarmRanks:
    """One idle group at most: ``put`` it with its shape and a ``stop`` that ends it; ``take`` a shape's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: tuple[Hashable, Any, Callable[[], None]] | None = None
        self._timer: threading.Timer | None = None

    def put(self, shape: Hashable, group: Any, stop: Callable[[], None], keep_s: float) -> None:
        """Keep ``group`` for ``keep_s`` seconds (whatever waited before is stopped: one at a time)."""
        timer = threading.Timer(keep_s, self._expire, args=(group,))
        timer.daemon = True
        with self._lock:
            old = self._detach()
            self._held, self._timer = (shape, group, stop), timer
        timer.start()
        if old is not None:
            _stop(old)

    def take(self, shape: Hashable) -> Any | None:
        """The waiting group of ``shape`` (no longer waiting), or None; a group of another shape is stopped, so
        that the resources it reserved are free for the one about to start."""
        with self._lock:
            held = self._detach()
        if held is None:
            return None
        if held[0] == shape:
            return held[1]
        _stop(held)
        return None

    def clear(self) -> None:
        """Stop whatever waits (the server's end, Ray's shutdown)."""
        with self._lock:
            held = self._detach()
        if held is not None:
            _stop(held)

    def waiting(self) -> Any | None:
        with self._lock:
            return None if self._held is None else self._held[1]

    def _detach(self) -> tuple[Hashable, Any, Callable[[], None]] | None:
        held, self._held = self._held, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return held

    def _expire(self, group: Any) -> None:
        with self._lock:
            if self._held is None or self._held[1] is not group:
                return  # taken, or replaced, meanwhile
            held = self._detach()
        if held is not None:
            log.info("trainer ranks idle too long: stopped")
            _stop(held)


def _stop(held: tuple[Hashable, Any, Callable[[], None]]) -> None:
    try:
        held[2]()
    except Exception:  # noqa: BLE001 - Ray may be gone already (its end took the processes with it)
        log.warning("stopping idle trainer ranks failed", exc_info=True)


WARM = WarmRanks()  # this process's (the server's): one Ray cluster, one idle group
