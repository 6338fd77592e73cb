"""Finishing sessions an agent walked away from.

Why: only finished trajectories train. An agent that posts ``final: false`` rewards, or never posts a
reward nor closes its sessions, would otherwise leave its episodes open for ever: never trained, and
never counted anywhere a user looks. ``IdleSessionSweeper`` closes every open session whose last write
is older than ``gateway.session_idle_timeout_s``, every ``interval_s`` (a tenth of the timeout, between
1 s and 60 s), in a worker thread so a slow store never stalls the event loop. Several gateway replicas
may sweep one Postgres store at once (the store skips rows another replica holds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

log = logging.getLogger(__name__)

IDLE_CLOSED = Counter("slime_sessions_idle_closed_total", "open sessions closed after sitting idle past "
                      "gateway.session_idle_timeout_s")


class IdleSessionSweeper:
    """``await sweeper.run()`` until cancelled; ``sweep()`` once (what the task repeats)."""

    def __init__(self, store: Any, timeout_s: float, *, clock: Callable[[], float] = time.time,
                 interval_s: float | None = None) -> None:
        self.store, self.timeout_s, self.clock = store, timeout_s, clock
        self.interval_s = interval_s if interval_s is not None else min(60.0, max(1.0, timeout_s / 10))

    def sweep(self) -> list[str]:
        """Close every session idle past the timeout (in pages of 1000); returns their ids."""
        closed: list[str] = []
        while True:
            page = self.store.close_idle_sessions(self.clock() - self.timeout_s)
            closed += page
            if len(page) < 1000:
                break
        if closed:
            IDLE_CLOSED.inc(len(closed))
            log.info("closed %d sessions idle for more than %.0f s", len(closed), self.timeout_s)
        return closed

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sweep)
            except Exception:  # noqa: BLE001 - a store hiccup (locked, restarting) must not end the sweeps
                log.exception("idle session sweep failed; retrying in %.0f s", self.interval_s)
            await asyncio.sleep(self.interval_s)
