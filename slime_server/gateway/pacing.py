"""Buffer pacing (ARCHITECTURE decision 7): a training request waits (429 + Retry-After) while the running
job's buffer of finished, rewarded, untrained trajectories is full.

Why the gateway's and not the job manager's: it is an admission decision on incoming requests; the
manager only says which job runs and what pacing it asked for (``JobManager.active_pacing``). The count
is read from the store at most every 0.5 s, so a burst of requests costs one query."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

ADMISSION_REJECTED = Counter("slime_admission_rejected_total", "requests answered 429 by buffer pacing")
COUNT_TTL_S = 0.5


class Pacer:
    """``retry_after()``: seconds a training request should wait, or None to admit it."""

    def __init__(self, store: Any, jobs: Callable[[], Any]) -> None:
        self.store, self.jobs = store, jobs  # jobs(): the JobManager, attached after the gateway is built
        self._lock = threading.Lock()
        self._count: tuple[float, int] = (float("-inf"), 0)  # (when read, unconsumed finished rewarded)

    def retry_after(self) -> float | None:
        manager = self.jobs()
        pacing = manager.active_pacing() if manager is not None else None
        if pacing is None:
            return None
        with self._lock:
            read_at, n = self._count
            if time.monotonic() - read_at > COUNT_TTL_S:
                n = self.store.stats().unconsumed_finished_rewarded
                self._count = (time.monotonic(), n)
        if n >= pacing.max_buffered:
            ADMISSION_REJECTED.inc()
            return pacing.retry_after_s
        return None
