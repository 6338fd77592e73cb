"""Engine actors: each owns one inference server process (our CPU engine or SGLang).

``EngineActor`` is a plain class so it can be used and tested without Ray; ``launch.py`` wraps it
with ``ray.remote``. The actor picks a free port on its own node, starts the server in its own process
group (``owned.spawn_owned``: killed by the kernel if the actor process dies first), waits for ``/health``, and a monitor thread
restarts the server on the same port if it dies, so the URL the router knows stays valid.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from slime_server.config import EngineKind
from slime_server.rollout.owned import spawn_owned
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group


class EngineSpec(BaseModel):
    """Everything an actor needs to start its engine (sent from the driver, so plain data)."""

    kind: EngineKind = "cpu"
    model_path: str
    host: str = "127.0.0.1"
    port: int = Field(0, description="0 picks a free port on the actor's node")
    max_running_requests: int = 32
    torch_threads: int = 1
    sglang_args: dict[str, Any] = Field(default_factory=dict)
    startup_timeout_s: float = 300.0
    health_interval_s: float = 5.0
    log_path: str | None = None
    extra_env: dict[str, str] = Field(default_factory=dict)


class EngineStatus(BaseModel):
    """What an actor reports about its engine."""

    url: str
    pid: int | None
    alive: bool
    healthy: bool
    restarts: int
    kind: EngineKind
    node_ip: str
    log_path: str | None = None


def engine_command(spec: EngineSpec, port: int) -> list[str]:
    """The server command line for ``spec`` on ``port``."""
    if spec.kind == "sglang":
        from slime_server.config import EngineSettings
        from slime_server.rollout.sglang_launcher import build_sglang_command

        engine = EngineSettings(kind="sglang", host=spec.host, max_running_requests=spec.max_running_requests,
                                sglang_args=spec.sglang_args)
        return build_sglang_command(engine, spec.model_path, port)
    return [
        sys.executable, "-m", "slime_server.rollout.engine_server",
        "--model-path", spec.model_path, "--host", spec.host, "--port", str(port),
        "--max-running-requests", str(spec.max_running_requests), "--num-threads", str(spec.torch_threads),
    ]


class EngineActor:
    """Starts, watches, restarts and stops one engine server process."""

    def __init__(self, spec: EngineSpec, start: bool = True, monitor: bool = True) -> None:
        self.spec = spec
        self.port = spec.port or find_free_port(spec.host)
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._monitor_enabled = monitor
        self._monitor: threading.Thread | None = None
        if start:
            self.start()

    def url(self) -> str:
        """Where the router reaches the engine: the node's IP when bound to all interfaces."""
        host = _node_ip() if self.spec.host in ("0.0.0.0", "::") else self.spec.host
        return f"http://{host}:{self.port}"

    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        """The server command line (a subclass may serve something else behind the same protocol)."""
        return engine_command(self.spec, self.port)

    def start(self) -> str:
        """Start the server and block until ``/health`` answers; returns the URL."""
        with self._lock:
            self._stopping.clear()
            return self._start()

    def _start(self) -> str:
        """Start under the lock, leaving ``_stopping`` alone (a concurrent stop() must win)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self.url()
            env = {"OMP_NUM_THREADS": str(self.spec.torch_threads), "TOKENIZERS_PARALLELISM": "false",
                   **self.spec.extra_env}
            self._proc = spawn_owned(self.command(), env=env, log_path=self.spec.log_path)
            self._ensure_monitor()  # from here on a dead engine is brought back, even if this start fails
            try:
                wait_http_ok(f"{self.url()}/health", timeout=self.spec.startup_timeout_s, proc=self._proc)
            except (TimeoutError, RuntimeError):
                self._kill()
                raise
            return self.url()

    def _ensure_monitor(self) -> None:
        if self._monitor_enabled and (self._monitor is None or not self._monitor.is_alive()):
            self._monitor = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
            self._monitor.start()

    def healthy(self, timeout: float = 5.0) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url()}/health", timeout=timeout).status_code < 300
        except httpx.HTTPError:
            return False

    def status(self) -> EngineStatus:
        alive = self._proc is not None and self._proc.poll() is None
        return EngineStatus(url=self.url(), pid=self.pid(), alive=alive, healthy=alive and self.healthy(),
                            restarts=self.restarts, kind=self.spec.kind, node_ip=_node_ip(),
                            log_path=self.spec.log_path)

    def restart(self) -> str:
        """Kill and start again on the same port (an operator's request; also revives a stopped one)."""
        with self._lock:
            self._stopping.clear()
            return self._restart()

    def _restart(self) -> str:
        with self._lock:
            self._kill()
            self.restarts += 1
            return self._start()

    def stop(self) -> None:
        """Stop the server for good (the monitor will not bring it back)."""
        self._stopping.set()
        with self._lock:
            self._kill()

    def _kill(self) -> None:
        if self._proc is not None:
            kill_group(self._proc, timeout=10.0)
            self._proc = None

    def _watch(self) -> None:
        """Restart the engine when its process exits unexpectedly (retrying each interval until stop())."""
        while not self._stopping.wait(self.spec.health_interval_s):
            with self._lock:
                dead = self._proc is None or self._proc.poll() is not None
                if dead and not self._stopping.is_set():
                    try:
                        self._restart()
                    except (TimeoutError, RuntimeError, OSError) as e:
                        print(f"[engine-actor] restart of {self.url()} failed: {e}", file=sys.stderr, flush=True)

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self.stop()


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def log_path_for(log_dir: str | Path | None, name: str) -> str | None:
    """``<log_dir>/<name>.log`` or None when logs go to the parent's output."""
    return str(Path(log_dir) / f"{name}.log") if log_dir else None
