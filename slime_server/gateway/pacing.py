"""Buffer pacing (ARCHITECTURE decision 7): a training request waits (429 + Retry-After) while the running
job's buffer of finished, rewarded, untrained trajectories is full.

Why the gateway's and not the job manager's: it is an admission decision on incoming requests; the
manager only says which job runs and what pacing it asked for (``JobManager.active_pacing``, from memory).
The count is read from the store at most every 0.5 s, so a burst of requests costs one query, and that
query reads the pick index (``store.count_ready``), not every trajectory the store ever kept."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

ADMISSION_REJECTED = Counter("slime_admission_rejected_total", "requests answered 429 by buffer pacing")
COUNT_TTL_S = 0.5


class Pacer:
    """``retry_after()``: seconds a training request should wait, or None to admit it. ``cached()`` answers
    the same without touching the store while the count is fresh, so most requests decide on the event
    loop (a thread hop each otherwise)."""

    def __init__(self, store: Any, jobs: Callable[[], Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.jobs, self.clock = store, jobs, clock  # jobs(): the JobManager, attached later
        self._lock = threading.Lock()
        self._count: tuple[float, int] = (float("-inf"), 0)  # (when read, unconsumed finished rewarded)

    def _pacing(self) -> Any:
        manager = self.jobs()
        return manager.active_pacing() if manager is not None else None

    def cached(self) -> tuple[bool, float | None]:
        """(known, retry_after): known is False when the count is older than ``COUNT_TTL_S`` (then call
        ``retry_after``, which reads it; off the event loop)."""
        pacing = self._pacing()
        if pacing is None:
            return True, None
        with self._lock:
            read_at, n = self._count
        if self.clock() - read_at > COUNT_TTL_S:
            return False, None
        return True, _decide(pacing, n)

    def retry_after(self) -> float | None:
        pacing = self._pacing()
        if pacing is None:
            return None
        with self._lock:
            read_at, n = self._count
            if self.clock() - read_at > COUNT_TTL_S:
                n = self.store.count_ready()
                self._count = (self.clock(), n)
        return _decide(pacing, n)


def _decide(pacing: Any, buffered: int) -> float | None:
    if buffered >= pacing.max_buffered:
        ADMISSION_REJECTED.inc()
        return pacing.retry_after_s
    return None
