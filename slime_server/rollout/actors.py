"""Engine actors: each owns one inference server process (our CPU engine or SGLang).

``EngineActor`` is a plain class so it can be used and tested without Ray; ``server/launch.py`` wraps it
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
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from slime_server.config import EngineKind, EngineSettings
from slime_server.rollout.engine_auth import KEY_ENV, check_exposure
from slime_server.rollout.owned import spawn_owned, start_retrying
from slime_server.rollout.sglang_launcher import build_sglang_command
from slime_server.utils.affinity import format_cpu_list, pin_pid
from slime_server.utils.net import find_free_port, tls_context, wait_http_ok
from slime_server.utils.procs import cli_flags, kill_group


class EngineSpec(BaseModel):
    """Everything an actor needs to start its engine (sent from the driver, so plain data)."""

    kind: EngineKind = "cpu"
    model_path: str
    host: str = "127.0.0.1"
    port: int = Field(0, description="0 picks a free port on the actor's node")
    api_key: str | None = Field(None, description="SGLang's --api-key (the deployment's engine key)")
    insecure: bool = Field(False, description="allow a non-loopback host with no key (--insecure-engines)")
    max_running_requests: int = 32
    torch_threads: int = Field(0, description="the CPU engine's torch threads (0: one per core it may run on)")
    cpus: list[int] | None = Field(None, description="cores the engine process runs on (None: any)")
    cpu_forward: Literal["lean", "hf"] = "lean"
    prefix_cache_mb: float = 512.0
    lora: dict[str, Any] = Field(default_factory=dict, description="optional serving flags by SGLang's ServerArgs "
                                 "names (lora_args: LoRA, routed experts), for either kind")
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
    node_id: str | None = Field(None, description="the Ray node (None outside Ray)")
    log_path: str | None = None


LORA_FIELDS = ("enable_lora", "lora_paths", "max_lora_rank", "lora_target_modules", "max_loras_per_batch",
               "max_loaded_loras")


def lora_args(engine: EngineSettings) -> dict[str, Any]:
    """The engine settings' optional serving flags, named as SGLang's ServerArgs (and the CPU engine's flags) name
    them: LoRA's unless LoRA is off (``enable_lora`` or adapters to load), and an MoE model's routed experts."""
    routes = {"enable_return_routed_experts": True} if engine.enable_return_routed_experts else {}
    if not (engine.enable_lora or engine.lora_paths):
        return routes
    args = {name: getattr(engine, name) for name in LORA_FIELDS}
    return {**args, "enable_lora": True, "lora_paths": args["lora_paths"] or None, **routes}


def engine_command(spec: EngineSpec, port: int) -> list[str]:
    """The server command line for ``spec`` on ``port``. SGLang takes its key only as ``--api-key``; the CPU
    engine gets it in its environment (``engine_env``), out of ``ps``'s sight."""
    if spec.kind == "sglang":
        engine = EngineSettings(kind="sglang", host=spec.host, max_running_requests=spec.max_running_requests,
                                sglang_args=spec.sglang_args)
        cmd = build_sglang_command(engine, spec.model_path, port, api_key=spec.api_key, optional_args=spec.lora)
        # SGLang has no core option: taskset pins it before it starts a thread (the CPU engine pins itself)
        return ["taskset", "-c", format_cpu_list(spec.cpus), *cmd] if spec.cpus else cmd
    return [
        sys.executable, "-m", "slime_server.rollout.engine_server",
        "--model-path", spec.model_path, "--host", spec.host, "--port", str(port),
        "--max-running-requests", str(spec.max_running_requests), "--num-threads", str(spec.torch_threads),
        "--forward", spec.cpu_forward, "--prefix-cache-mb", str(spec.prefix_cache_mb),
        *(["--insecure-engines"] if spec.insecure else []),
        *(["--cpus", format_cpu_list(spec.cpus)] if spec.cpus else []),
        *cli_flags(spec.lora),
    ]


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """Environment of the engine process: thread counts, the CPU engine's key, the spec's extras."""
    threads = spec.torch_threads or (len(spec.cpus) if spec.cpus else 0)
    env = {"TOKENIZERS_PARALLELISM": "false", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    if spec.kind == "cpu" and spec.api_key:
        env[KEY_ENV] = spec.api_key
    return {**env, **spec.extra_env}


class EngineActor:
    """Starts, watches, restarts and stops one engine server process."""

    def __init__(self, spec: EngineSpec, start: bool = True, monitor: bool = True) -> None:
        if check_exposure(spec.host, spec.api_key, spec.insecure):  # SGLang itself would start keyless
            print(f"[engine-actor] warning: engine on {spec.host} has no API key (--insecure-engines)",
                  file=sys.stderr, flush=True)
        self.spec = spec
        self.port = spec.port or find_free_port(spec.host)
        self._port_is_ours = not spec.port  # chosen here: a first start may choose again if it was taken
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
        """Start under the lock, leaving ``_stopping`` alone (a concurrent stop() must win).

        A port chosen free here can be taken before the engine binds it (Ray workers, routers and other
        engines start at the same time): the engine then exits logging "address already in use". On its
        first start, before anything knows its URL, it is started again on a fresh port (twice at most);
        any other early exit, a fixed port or a restart (the router knows the URL) fails as before."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self.url()
            log_offset = 0

            def launch() -> None:
                nonlocal log_offset
                log_offset = _size(self.spec.log_path)
                self._proc = spawn_owned(self.command(), env=engine_env(self.spec), log_path=self.spec.log_path)
                self._ensure_monitor()  # from here on a dead engine is brought back, even if this start fails

            def again() -> bool:
                if not (self._port_is_ours and self.restarts == 0 and _port_was_taken(self.spec.log_path, log_offset)):
                    return False
                print(f"[engine-actor] port {self.port} was taken before the engine bound it; choosing "
                      "another", file=sys.stderr, flush=True)
                self.port = find_free_port(self.spec.host)
                return True

            start_retrying(launch, lambda: wait_http_ok(f"{self.url()}/health", timeout=self.spec.startup_timeout_s,
                                                        proc=self._proc), self._kill, again)
            return self.url()

    def _ensure_monitor(self) -> None:
        if self._monitor_enabled and (self._monitor is None or not self._monitor.is_alive()):
            self._monitor = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
            self._monitor.start()

    def healthy(self, timeout: float = 5.0) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url()}/health", timeout=timeout, verify=tls_context()).status_code < 300
        except httpx.HTTPError:
            return False

    def set_cpus(self, cpus: list[int]) -> None:
        """Move the running engine (every thread) onto ``cpus``, and start it there after a restart. A CPU
        engine with no fixed thread count resizes torch's pool to them before its next step."""
        with self._lock:
            self.spec = self.spec.model_copy(update={"cpus": list(cpus)})
            if self._proc is not None and self._proc.poll() is None:
                pin_pid(self._proc.pid, cpus)  # one that died meanwhile has no threads left to move

    def status(self) -> EngineStatus:
        alive = self._proc is not None and self._proc.poll() is None
        return EngineStatus(url=self.url(), pid=self.pid(), alive=alive, healthy=alive and self.healthy(),
                            restarts=self.restarts, kind=self.spec.kind, node_ip=_node_ip(), node_id=_node_id(),
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


def _size(path: str | Path | None) -> int:
    try:
        return Path(path).stat().st_size if path is not None else 0
    except FileNotFoundError:
        return 0


def _port_was_taken(log_path: str | Path | None, offset: int) -> bool:
    """Whether the engine's log, from ``offset`` on, says its port was in use (uvicorn: "[Errno 98] error
    while attempting to bind on address ...: address already in use", SGLang's server is uvicorn too)."""
    if log_path is None:
        return False
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return b"address already in use" in f.read().lower()
    except FileNotFoundError:
        return False


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None


def log_path_for(log_dir: str | Path | None, name: str) -> str | None:
    """``<log_dir>/<name>.log`` or None when logs go to the parent's output."""
    return str(Path(log_dir) / f"{name}.log") if log_dir else None
