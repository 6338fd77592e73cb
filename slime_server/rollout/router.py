"""Owns one real sgl-router process (``python -m sglang_router.launch_router``) and talks to its
worker API.

Facts about sglang-router 0.3.2, checked by running it (the older ``/add_worker?url=`` and
``/list_workers`` routes answer 404 there):
- ``GET /workers`` lists workers; ``POST /workers {"url": ...}`` answers 202 and registers the worker
  in the background (probing the worker's ``/health``, ``/server_info``, ``/model_info``, falling back
  to the ``/get_*`` names, and retrying an unreachable URL until ``--worker-startup-timeout-secs``);
  ``DELETE /workers/{id}`` answers 202 and removes it in the background.
- ``/health``, ``/liveness`` and ``/readiness`` describe the router itself.
- It always exposes Prometheus metrics, on port 29000 unless told otherwise, so two routers on one
  host collide: we always give it a free ``--prometheus-port``.

Health checks and circuit breaker off, as slime launches it (``slime/ray/rollout.py``:
``router_args.disable_circuit_breaker = True`` and ``disable_health_check = True``, "we will not use the
health check from router"). Why: the router's checks cannot tell a paused engine from a dead one. On
SGLang (0.5.15 and 0.5.23) ``/health`` runs the same one-token generation as ``/health_generate``, which
waits while generation is paused for a weight update, so with a check every 10 s, a 5 s timeout and 3
failures, any pause longer than ~30 s marked every worker unhealthy. The circuit breaker opens on request
failures that say nothing about the worker (slime: transfer timeouts under load; here ten requests the
engine refused with 400 once made it answer 503 for a minute, see ARCHITECTURE.md "Bad input").
Our ``EngineSupervisor`` is the health monitor instead (as
slime's ``RolloutHealthMonitor``): it probes ``/health_generate``, takes engines out through
``DELETE /workers``, and suspends its verdicts while weights are being updated. So ``is_healthy`` in
``GET /workers`` stays true for every registered worker: membership is the health signal.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, field_validator

from slime_server.config import RouterSettings
from slime_server.rollout.engine_auth import KEY_ENV, auth_headers
from slime_server.rollout.owned import spawn_owned, start_retrying
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import cli_flags, kill_group, python_module_cmd


class RouterWorker(BaseModel):
    """One entry of the router's ``GET /workers``."""

    model_config = ConfigDict(extra="allow")

    id: str
    url: str
    is_healthy: bool = True
    load: int = 0
    worker_type: str = "regular"


class RouterWorkerList(BaseModel):
    """Body of the router's ``GET /workers``."""

    model_config = ConfigDict(extra="allow")

    workers: list[RouterWorker]
    total: int


class AddWorkerRequest(BaseModel):
    """Body of the router's ``POST /workers``. Validated here: the router itself accepts any string
    (``"not a url"`` gets 202) and then retries it in the background until its startup timeout."""

    url: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"worker URL must look like http://host:port, got {v!r}")
        return v.rstrip("/")


class WorkerJobAccepted(BaseModel):
    """202 answer of ``POST /workers`` and ``DELETE /workers/{id}``."""

    model_config = ConfigDict(extra="allow")

    status: str
    worker_id: str
    message: str = ""


class RouterError(RuntimeError):
    """The router refused a request or did not reach the expected state in time."""


def build_router_cmd(settings: RouterSettings, port: int, prometheus_port: int,
                     worker_urls: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The exact ``launch_router`` command line for ``settings``."""
    cmd = python_module_cmd(
        "slime_server.rollout.router_launch",  # sgl-router's launcher; adds --api-key from the environment
        "--host", settings.host,
        "--port", str(port),
        "--policy", settings.policy,
        "--request-timeout-secs", str(settings.request_timeout_secs),
        # slime's settings: the supervisor is the health monitor (module doc)
        "--disable-health-check",
        "--disable-circuit-breaker",
        "--worker-startup-timeout-secs", str(settings.worker_startup_timeout_secs),
        "--worker-startup-check-interval", "1",
        "--prometheus-host", settings.host,
        "--prometheus-port", str(prometheus_port),
        "--log-level", settings.log_level,
    )
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    return cmd + cli_flags(settings.extra_args)


class RouterProcess:
    """Starts, queries and stops one sgl-router; the process lives in its own process group."""

    def __init__(self, settings: RouterSettings | None = None, log_path: str | Path | None = None,
                 api_key: str | None = None) -> None:
        """``api_key``: the engines' key. The router then demands it from its own clients (``/generate``,
        ``/workers``) and sends it to the engines."""
        self.settings = settings or RouterSettings()
        self.log_path = str(log_path) if log_path else None
        self.port = self.settings.port or find_free_port(self.settings.host)
        self.prometheus_port = find_free_port(self.settings.host)
        self.api_key = api_key
        self._proc: subprocess.Popen | None = None
        self._http = httpx.Client(timeout=10.0, headers=auth_headers(api_key))

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, worker_urls: list[str] | tuple[str, ...] = ()) -> RouterProcess:
        """Spawn the router and wait until its own ``/health`` answers.

        A port we chose free can be taken before the router binds it (Ray, engines and other routers start
        at the same time); the router then exits at once ("Address already in use"). So an early exit is
        retried on freshly chosen ports (a port the settings fixed stays), twice at most."""
        if self._proc is not None and self._proc.poll() is None:
            raise RouterError("router already running")
        env = {"RUST_LOG_STYLE": "never", "NO_COLOR": "1", **({KEY_ENV: self.api_key} if self.api_key else {})}

        def launch() -> None:
            cmd = build_router_cmd(self.settings, self.port, self.prometheus_port, worker_urls)
            self._proc = spawn_owned(cmd, env=env, log_path=self.log_path)

        def again() -> bool:
            self.prometheus_port = find_free_port(self.settings.host)
            if not self.settings.port:
                self.port = find_free_port(self.settings.host)
            return True

        def ready() -> None:
            # /workers, not /health: when another server took our port first, its /health may answer 2xx while
            # our router dies of "Address already in use" (seen once in CI: an engine's port); engines and
            # gateways have no /workers, so only a router answers it
            wait_http_ok(f"{self.url}/workers", timeout=self.settings.startup_timeout_s, proc=self._proc,
                         headers=auth_headers(self.api_key))
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"router exited with code {self._proc.returncode} once ready")

        start_retrying(launch, ready, self.stop, again)
        return self

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def list_workers(self) -> list[RouterWorker]:
        r = self._http.get(f"{self.url}/workers")
        _raise_for(r, "list workers")
        return RouterWorkerList.model_validate(r.json()).workers

    def worker_urls(self, healthy_only: bool = False) -> list[str]:
        return [w.url for w in self.list_workers() if w.is_healthy or not healthy_only]

    def add_worker(self, url: str, wait: bool = True, timeout: float = 60.0) -> str:
        """Register ``url``; with ``wait``, return only once the router lists it as healthy.

        Raises ValueError for a malformed URL; on timeout the pending registration is withdrawn.
        """
        req = AddWorkerRequest(url=url)
        url = req.url
        r = self._http.post(f"{self.url}/workers", json=req.model_dump())
        _raise_for(r, f"add worker {url}")
        worker_id = WorkerJobAccepted.model_validate(r.json()).worker_id
        if wait:
            try:
                self._wait_for(lambda ws: any(w.url == url and w.is_healthy for w in ws), timeout,
                               f"worker {url} to become healthy in the router")
            except RouterError:
                if self.is_alive():
                    self._http.delete(f"{self.url}/workers/{worker_id}")
                raise
        return worker_id

    def remove_worker(self, url: str, wait: bool = True, timeout: float = 30.0) -> None:
        """Deregister ``url`` (no-op if unknown); with ``wait``, return once it is gone from the list."""
        url = url.rstrip("/")
        for w in self.list_workers():
            if w.url == url:
                r = self._http.delete(f"{self.url}/workers/{w.id}")
                _raise_for(r, f"remove worker {url}")
        if wait:
            self._wait_for(lambda ws: all(w.url != url for w in ws), timeout, f"worker {url} to leave the router")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the router's process group; SIGKILL after ``timeout``."""
        if self._proc is not None:
            kill_group(self._proc, timeout=timeout)
            self._proc = None

    def close(self) -> None:
        self.stop()
        self._http.close()

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_for(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self.list_workers()):
                return
            if not self.is_alive():
                raise RouterError(f"router exited while waiting for {what}")
            time.sleep(0.1)
        raise RouterError(f"timed out after {timeout:.0f}s waiting for {what}")


def _raise_for(r: httpx.Response, what: str) -> None:
    if r.status_code >= 300:
        raise RouterError(f"router could not {what}: HTTP {r.status_code} {r.text[:300]}")
