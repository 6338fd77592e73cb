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

    def stop(self) -> None:
        try:
            self.gateway.stop()
        finally:
            self.deployment.shutdown()


def start_server(settings: ServerSettings, gw_settings: GatewaySettings, log_dir: str | Path | None) -> RunningServer:
    """Engines + router under Ray, then the gateway in front of the router."""
    from slime_server.api.server import build_gateway
    from slime_server.launch import Deployment, resolve_model_path

    model_path = resolve_model_path(settings.engine.model)
    dep = Deployment.start(settings, log_dir=log_dir)
    try:
        print(f"router_url: {dep.router_url}", flush=True)
        app = build_gateway(dep.router_url, model_path, gw_settings)
        gateway = GatewayThread(app, gw_settings.host, gw_settings.port).start()
    except BaseException:
        dep.shutdown()
        raise
    return RunningServer(dep, gateway, f"http://{gw_settings.host}:{gw_settings.port}/v1")


class ServeCommand:
    help = "serve the OpenAI-compatible /v1 API over engines behind the sgl-router, recording trajectories"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default=None, help="gateway host (default: settings gateway.host)")
        parser.add_argument("--port", type=int, default=None, help="gateway port (default: settings gateway.port)")
        parser.add_argument("--api-key", default=None, help="protect /v1 with this Bearer key")
        parser.add_argument("--db-path", default=None, help="SQLite trajectory store file")
        parser.add_argument("--log-dir", default=None, help="engine and router logs (default: a temp dir)")

    def run(self, args: argparse.Namespace, settings: ServerSettings) -> int:
        from slime_server.cli import run_until_signal

        overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key),
                                       ("db_path", args.db_path)) if v is not None}
        gw_settings = settings.gateway.model_copy(update=overrides)

        def start() -> RunningServer:
            running = start_server(settings, gw_settings, args.log_dir)
            print(f"openai_base_url: {running.base_url}", flush=True)
            return running

        code = run_until_signal(start, lambda running: running.stop())
        print("stopped", flush=True)
        return code
