"""Engine supervision on the serving side: a dead engine leaves the router at once, and a restarted
one re-enters only once it serves the current weights (issue 9, "Faults").

Why here and not in the engine actor: the actor restarts its process on the same port, but it
knows neither the router nor the weights. A freshly started engine holds the base model (or
whatever its model path holds), while the others may be versions ahead; letting it take traffic
would record turns from the wrong policy. So, every ``interval_s``:

1. an engine that refuses connections (process gone) is removed from the router: no new request
   goes there (requests already in flight fail over in the router's retries, or get a clear 503);
2. an engine back up gets the current weights from ``catch_up(url)`` (the running job's trainer:
   a bucketed push to that one engine) and only then is registered again. With no job running, it
   is compared with the weight version the engines serve (the others', or the last one seen when
   all of them died); a mismatch keeps it out of rotation (and says so in the log) rather than
   serve stale weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)

ENGINE_QUARANTINES = Counter("slime_engine_quarantines_total", "engines taken out of the router (unreachable)")
ENGINE_READMISSIONS = Counter("slime_engine_readmissions_total",
                              "restarted engines put back into the router, on the current weights")
ENGINES_OUT = Gauge("slime_engines_quarantined", "engines out of the router, waiting to be restarted / caught up")


class EngineSupervisor:
    """Keeps the router's workers to live engines on the current weights; see the module doc."""

    def __init__(self, engine_urls: Callable[[], list[str]], router: Any, *, interval_s: float = 0.5,
                 catch_up: Callable[[str], bool] | None = None) -> None:
        self.engine_urls = engine_urls
        self.router = router
        self.interval_s = interval_s
        self.catch_up = catch_up  # set by the job manager: push the current weights to one engine
        self._out: dict[str, float] = {}  # url -> when it was taken out
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0))
        self._known_version: str | None = None  # the newest version seen served (survives all engines dying)
        self._ticks = 0
        self.events: list[tuple[str, str]] = []  # (kind, url): what happened, for logs and tests

    # ------------------------------------------------------------------ views
    def serving_urls(self) -> list[str]:
        """The engines in rotation: the ones weight pushes go to (a quarantined one is caught up apart)."""
        with self._lock:
            out = set(self._out)
        return [u for u in self.engine_urls() if u not in out]

    def quarantined(self) -> list[str]:
        with self._lock:
            return list(self._out)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineSupervisor:
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - supervision must outlive any one bad round
                log.exception("engine supervisor round failed")

    # ------------------------------------------------------------------ one round
    def tick(self) -> None:
        self._ticks += 1
        for url in self.engine_urls():
            with self._lock:
                out = url in self._out
            if out:
                self._try_readmit(url)
            elif not self._reachable(url):
                self._quarantine(url)
            elif self._ticks % 10 == 1:
                self._remember(self._version(url))

    def _remember(self, version: str | None) -> None:
        if version is not None:
            self._known_version = max(filter(None, (self._known_version, version)), key=_version_key)

    def _reachable(self, url: str) -> bool:
        """False only when nothing listens (the process is gone); a slow answer is a busy engine."""
        try:
            self._http.get(f"{url}/health")
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            return False
        except httpx.HTTPError:
            return True
        return True

    def _version(self, url: str) -> str | None:
        try:
            r = self._http.get(f"{url}/get_weight_version")
            return str(r.json()["weight_version"]) if r.status_code == 200 else None
        except (httpx.HTTPError, KeyError, ValueError):
            return None

    def _healthy(self, url: str) -> bool:
        try:
            return self._http.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _quarantine(self, url: str) -> None:
        with self._lock:
            self._out[url] = time.monotonic()
            ENGINES_OUT.set(len(self._out))
        try:
            self.router.remove_worker(url)
        except Exception as e:  # noqa: BLE001 - the router may already have dropped it
            log.warning("removing %s from the router: %s", url, e)
        self.events.append(("quarantined", url))
        log.warning("engine %s is unreachable: out of the router until it is back on the current weights", url)

    def _expected_version(self, exclude: str) -> str | None:
        """What a readmitted engine must serve: the serving engines' newest version, else the last seen."""
        for v in (self._version(u) for u in self.serving_urls() if u != exclude):
            self._remember(v)
        return self._known_version

    def _try_readmit(self, url: str) -> None:
        if not self._healthy(url):
            return  # the actor's monitor is still bringing it back
        if self.catch_up is not None and self.catch_up(url):  # a running job pushed its current weights
            self.events.append(("caught_up", url))
        else:
            expected = self._expected_version(url)
            if expected is not None and self._version(url) != expected:
                if ("kept_out", url) not in self.events:
                    self.events.append(("kept_out", url))
                    log.warning("engine %s serves version %s, not %s, and no job can catch it up: kept out",
                                url, self._version(url), expected)
                return
        current = self._version(url)
        self._remember(current)
        self.router.add_worker(url, wait=True)
        with self._lock:
            self._out.pop(url, None)
            ENGINES_OUT.set(len(self._out))
        ENGINE_READMISSIONS.inc()
        self.events.append(("readmitted", url))
        log.warning("engine %s is back in the router on weight version %s", url, current)


def _version_key(v: str) -> tuple[int, str]:
    return (int(v) if v.lstrip("-").isdigit() else -1, v)
