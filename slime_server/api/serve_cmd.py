"""``slime-server serve``: engines + sgl-router (as ``slime-server engines``) + the gateway on top.

Why uvicorn in a thread with its signal handlers off: uvicorn re-raises SIGTERM/SIGINT after its
own graceful shutdown, which would kill the process before the engines and router are stopped.
Here the main thread owns the signals (``run_until_signal``): first the gateway stops taking
requests, then the engines and router go (no orphans), then the process exits 0.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_server.config import GatewaySettings, ServerSettings


class GatewayThread:
    """A uvicorn server for ``app`` on a background thread; ``start`` returns once it is bound."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # signals stay ours
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    def start(self, timeout: float = 60.0) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start (port in use?)")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)


@dataclass
class RunningServer:
    """What ``serve`` (and ``demo``) bring up, stopped in reverse order by ``stop``."""

    deployment: Any
    gateway: GatewayThread
    base_url: str
    jobs: Any = None  # JobManager

    def stop(self) -> None:
        try:
            self.gateway.stop()
            if self.jobs is not None:
                self.jobs.shutdown()  # jobs stay active in the store: the next start resumes them
        finally:
            self.deployment.shutdown()


def attach_jobs(gw: Any, settings: ServerSettings, model_path: str, engine_urls: Any) -> Any:
    """A JobManager over the gateway's store (jobs in the same SQLite file), restored from it."""
    from slime_server.buffer.job_store import SQLiteJobStore
    from slime_server.jobs import JobManager, JobSpec
    from slime_server.launch import start_trainer_group

    tr = settings.trainer

    def make_trainer(spec: JobSpec) -> Any:
        return start_trainer_group(model_path, tr, optimizer=spec.optimizer, loss=spec.loss_config())

    def colocated(loop: Any) -> None:
        if tr.colocate:  # the ranks share the engines' devices: never generate while they step
            loop.settings = loop.settings.model_copy(update={"sync": True})

    host = "127.0.0.1" if gw.settings.host in ("0.0.0.0", "::") else gw.settings.host
    jobs = JobManager(gw.store, SQLiteJobStore(gw.settings.db_path), make_trainer, engine_urls, tr.work_dir,
                      served_model=gw.model_name, loop_hook=colocated,
                      gateway_url=f"http://{host}:{gw.settings.port}/v1", api_key=gw.settings.api_key)
    gw.jobs = jobs
    restored = jobs.restore()
    if restored:
        print(f"resumed jobs: {' '.join(restored)}", flush=True)
    return jobs


def start_server(settings: ServerSettings, gw_settings: GatewaySettings, log_dir: str | Path | None,
                 *, trainer: bool = True) -> RunningServer:
    """Engines + router under Ray, the job manager (trainer ranks start per job), the gateway in front."""
    from slime_server.api.server import build_gateway
    from slime_server.launch import Deployment, resolve_model_path

    model_path = resolve_model_path(settings.engine.model)
    dep = Deployment.start(settings, log_dir=log_dir)
    jobs = None
    try:
        print(f"router_url: {dep.router_url}", flush=True)
        app = build_gateway(dep.router_url, model_path, gw_settings)
        if trainer:
            jobs = attach_jobs(app.state.gw, settings, model_path, lambda: dep.engine_urls)
        gateway = GatewayThread(app, gw_settings.host, gw_settings.port).start()
    except BaseException:
        if jobs is not None:
            jobs.shutdown()
        dep.shutdown()
        raise
    return RunningServer(dep, gateway, f"http://{gw_settings.host}:{gw_settings.port}/v1", jobs)


class ServeCommand:
    help = "serve the OpenAI-compatible /v1 API over engines behind the sgl-router, recording trajectories"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default=None, help="gateway host (default: settings gateway.host)")
        parser.add_argument("--port", type=int, default=None, help="gateway port (default: settings gateway.port)")
        parser.add_argument("--api-key", default=None, help="protect /v1 with this Bearer key")
        parser.add_argument("--admin-api-key", default=None, help="key for /jobs (default: --api-key)")
        parser.add_argument("--no-trainer", action="store_true", help="serve and record only (no /jobs)")
        parser.add_argument("--db-path", default=None, help="SQLite trajectory store file")
        parser.add_argument("--log-dir", default=None, help="engine and router logs (default: a temp dir)")

    def run(self, args: argparse.Namespace, settings: ServerSettings) -> int:
        from slime_server.cli import run_until_signal

        overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key),
                                       ("admin_api_key", args.admin_api_key), ("db_path", args.db_path))
                     if v is not None}
        gw_settings = settings.gateway.model_copy(update=overrides)

        def start() -> RunningServer:
            running = start_server(settings, gw_settings, args.log_dir, trainer=not args.no_trainer)
            print(f"openai_base_url: {running.base_url}", flush=True)
            return running

        code = run_until_signal(start, lambda running: running.stop())
        print("stopped", flush=True)
        return code
