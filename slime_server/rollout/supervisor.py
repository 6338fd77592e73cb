"""Engine supervision on the serving side: the health monitor of the engines behind the router (issue 9,
"Faults"). A dead or hung engine leaves the router, and a restarted one re-enters only once it serves
the current weights.

Why here and not in the router or the engine actor: the router's own health checks and circuit breaker
are off (as slime launches it, see ``rollout/router.py``) because they cannot tell a paused engine from a
dead one; the actor restarts its process on the same port, but it knows neither the router nor the
weights. A freshly started engine holds the base model (or whatever its model path holds), while the
others may be versions ahead; letting it take traffic would record turns from the wrong policy.

Two loops:

1. **liveness**, every ``interval_s``: ``GET /model_info`` (cheap: no generation, answered while paused;
   on SGLang ``/health`` runs a generation too). An engine that refuses connections (process gone) is
   removed from the router at once: no new request goes there (requests already in flight fail over in
   the router's retries, or get a clear 503). A slow answer is a busy engine, not a dead one.
2. **health**, every ``health_interval_s``: ``GET /health_generate`` on every engine in parallel (what
   slime's ``RolloutHealthMonitor`` probes), timeout ``health_timeout_s``. After
   ``health_failure_threshold`` failures in a row (timeout or non-200) an engine that still answers but
   cannot generate is taken out too.

An engine out of the router comes back once ``/health_generate`` answers 200 again (probed at once for a
process that was gone; by the health loop for one that hung, so a hung engine never stalls the liveness
loop) and it has the current weights: ``catch_up(url)`` (the running job's trainer: a bucketed push to
that one engine), or, with no job running, it must already serve the version the engines serve (the
others', or the last one seen when all of them died); a mismatch keeps it out (and says so in the log)
rather than serve stale weights.

**Weight updates** (``with supervisor.updating_weights(): push``): SGLang's ``/health_generate`` waits
while generation is paused (up to its ``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s, then 503), and a push or a
sync-mode train step pauses engines for as long as it takes. Inside the block, as slime pauses its
monitor around weight updates, health failures are no verdict: probes that fail, or that started before
the block ended, count for nothing, no engine is taken out for being slow or failing, and every engine
starts again from zero failures when the block ends. A process that is really gone (connection refused)
is still taken out during an update: it cannot take part in the update (the pusher reports it), the
router must stop sending it requests, and it is caught up after its restart like any other. Blocks nest
and may overlap (the job's push, a catch-up push); verdicts resume when the last one ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
from prometheus_client import Counter, Gauge

from slime_server.rollout.engine_auth import auth_headers
from slime_server.rollout.engine_info import (
    MODEL_INFO_PATH,
    engine_weight_version,
    weight_version_from_response,
)
from slime_server.utils.net import engine_limits

log = logging.getLogger(__name__)

ENGINE_QUARANTINES = Counter("slime_engine_quarantines_total",
                             "engines taken out of the router (unreachable, or failing /health_generate)")
ENGINE_READMISSIONS = Counter("slime_engine_readmissions_total",
                              "restarted engines put back into the router, on the current weights")
ENGINES_OUT = Gauge("slime_engines_quarantined", "engines out of the router, waiting to be restarted / caught up")
HEALTH_SUSPENDED = Gauge("slime_engine_health_suspended",
                         "1 while a weight update suspends the engine health verdicts")

HEALTH_PATH = "/health_generate"


class EngineSupervisor:
    """Keeps the router's workers to live, generating engines on the current weights; see the module doc."""

    def __init__(self, engine_urls: Callable[[], list[str]], router: Any, *, interval_s: float = 0.5,
                 catch_up: Callable[[str], bool] | None = None, health_interval_s: float | None = 10.0,
                 health_timeout_s: float = 5.0, health_failure_threshold: int = 3,
                 api_key: str | None = None) -> None:
        if health_failure_threshold < 1:
            raise ValueError("health_failure_threshold must be >= 1")
        self.engine_urls = engine_urls
        self.router = router
        self.interval_s = interval_s
        self.catch_up = catch_up  # set by the job manager: push the current weights to one engine
        # slime's defaults (--rollout-health-check-interval 10, --rollout-health-check-timeout 5); None: off
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.health_failure_threshold = health_failure_threshold
        self._out: dict[str, tuple[float, str]] = {}  # url -> (when it was taken out, why)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        headers = auth_headers(api_key)  # the engines' key (their /model_info needs it)
        # probes every few seconds: idle connections must expire before the engine closes them
        self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), headers=headers, limits=engine_limits())
        self._health_http = httpx.Client(timeout=httpx.Timeout(health_timeout_s, connect=min(health_timeout_s, 1.0)),
                                         headers=headers, limits=engine_limits())
        self._known_version: str | None = None  # the newest version seen served (survives all engines dying)
        self._ticks = 0
        # health verdicts (under _lock): consecutive failures, when the last passing probe started
        self._fails: dict[str, int] = {}
        self._passed_at: dict[str, float] = {}
        self._updating = 0  # weight updates in progress (updating_weights blocks nest and overlap)
        self._update_epoch = 0  # bumped when a block starts or ends: a probe that spans either is void
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

    @property
    def health_suspended(self) -> bool:
        with self._lock:
            return self._updating > 0

    # ------------------------------------------------------------------ weight updates
    @contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Suspend the health verdicts while engines are paused for weights (see the module doc)."""
        with self._lock:
            self._updating += 1
            self._update_epoch += 1
            HEALTH_SUSPENDED.set(1)
        try:
            yield
        finally:
            with self._lock:
                self._updating -= 1
                self._update_epoch += 1
                if self._updating == 0:
                    self._fails.clear()  # a fresh start: the engines have just been resumed
                    HEALTH_SUSPENDED.set(0)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineSupervisor:
        loops = [("engine-supervisor", self._run, self.interval_s)]
        if self.health_interval_s:
            loops.append(("engine-health", self._run_health, self.health_interval_s))
        for name, target, _ in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=max(10.0, self.health_timeout_s + 5))
        self._http.close()
        self._health_http.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - supervision must outlive any one bad round
                log.exception("engine supervisor round failed")

    def _run_health(self) -> None:
        assert self.health_interval_s
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check_health()
            except Exception:  # noqa: BLE001
                log.exception("engine health round failed")

    # ------------------------------------------------------------------ liveness: one round
    def tick(self) -> None:
        self._ticks += 1
        for url in self.engine_urls():
            with self._lock:
                out = url in self._out
                unhealthy = (self._updating == 0
                             and self._fails.get(url, 0) >= self.health_failure_threshold)
            if out:
                self._try_readmit(url)
            elif not self._alive(url):
                self._quarantine(url, "unreachable")
            elif unhealthy:
                self._quarantine(url, "unhealthy")

    def _remember(self, version: str | None) -> None:
        if version is not None:
            self._known_version = max(filter(None, (self._known_version, version)), key=_version_key)

    def _alive(self, url: str) -> bool:
        """False only when nothing listens (the process is gone); a slow answer is a busy engine."""
        try:
            r = self._http.get(f"{url}{MODEL_INFO_PATH}")
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            return False
        except httpx.HTTPError:
            return True
        self._remember(weight_version_from_response(r))
        return True

    def _version(self, url: str) -> str | None:
        return engine_weight_version(self._http, url)

    # ------------------------------------------------------------------ health: one round
    def _probe(self, url: str) -> bool:
        """``/health_generate`` answered 200 within ``health_timeout_s``."""
        try:
            return self._health_http.get(f"{url}{HEALTH_PATH}").status_code == 200
        except httpx.HTTPError:
            return False

    def check_health(self) -> None:
        """Probe every engine's ``/health_generate`` in parallel and record the verdicts."""
        urls = self.engine_urls()
        if not urls:
            return
        with self._lock:
            epoch = self._update_epoch
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=min(len(urls), 16), thread_name_prefix="engine-health") as pool:
            results = list(zip(urls, pool.map(self._probe, urls), strict=True))
        with self._lock:
            void = self._updating > 0 or self._update_epoch != epoch  # paused for weights: no verdict
            for url, ok in results:
                if ok:
                    self._fails[url] = 0
                    self._passed_at[url] = started
                elif not void:
                    self._fails[url] = self._fails.get(url, 0) + 1
                    if self._fails[url] == self.health_failure_threshold and url not in self._out:
                        log.warning("engine %s failed %d /health_generate probes in a row", url, self._fails[url])

    def _passed_since(self, url: str, since: float) -> bool:
        with self._lock:
            return self._passed_at.get(url, float("-inf")) >= since

    # ------------------------------------------------------------------ out and back in
    def _quarantine(self, url: str, reason: str) -> None:
        with self._lock:
            self._out[url] = (time.monotonic(), reason)
            self._fails.pop(url, None)
            ENGINES_OUT.set(len(self._out))
        ENGINE_QUARANTINES.inc()
        try:
            self.router.remove_worker(url)
        except Exception as e:  # noqa: BLE001 - the router may already have dropped it
            log.warning("removing %s from the router: %s", url, e)
        if reason != "unreachable":
            self.events.append((reason, url))
        self.events.append(("quarantined", url))
        what = "is unreachable" if reason == "unreachable" else "does not generate (/health_generate)"
        log.warning("engine %s %s: out of the router until it is back on the current weights", url, what)

    def _expected_version(self, exclude: str) -> str | None:
        """What a readmitted engine must serve: the serving engines' newest version, else the last seen."""
        for v in (self._version(u) for u in self.serving_urls() if u != exclude):
            self._remember(v)
        return self._known_version

    def _back_up(self, url: str) -> bool:
        with self._lock:
            since, reason = self._out[url]
        if reason == "unhealthy":  # it hung: only the health loop probes it, so a hang never stalls this loop
            return self._passed_since(url, since)
        return self._probe(url)  # it was gone: refuses at once until restarted, then answers quickly

    def _try_readmit(self, url: str) -> None:
        if not self._back_up(url):
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
            self._fails.pop(url, None)
            ENGINES_OUT.set(len(self._out))
        ENGINE_READMISSIONS.inc()
        self.events.append(("readmitted", url))
        log.warning("engine %s is back in the router on weight version %s", url, current)


def _version_key(v: str) -> tuple[int, str]:
    return (int(v) if v.lstrip("-").isdigit() else -1, v)
