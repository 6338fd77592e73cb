"""`slime-server engines`: Ray, N rollout engines and the sgl-router, until Ctrl-C/SIGTERM (no gateway, no
trainer): for driving engines from elsewhere, and for tests."""

from __future__ import annotations

import argparse

from slime_server.config import ServerSettings
from slime_server.server.launch import Deployment
from slime_server.utils.procs import run_until_signal


class EnginesCommand:
    help = "start Ray, N rollout engines and the sgl-router; print the router URL; stop on Ctrl-C/SIGTERM"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--log-dir", default=None, help="engine and router logs (default: a temp dir)")

    def run(self, args: argparse.Namespace, settings: ServerSettings) -> int:
        def start() -> Deployment:
            dep = Deployment.start(settings, log_dir=args.log_dir)
            print(f"router_url: {dep.router_url}", flush=True)
            for url in dep.engine_urls:
                print(f"engine_url: {url}", flush=True)
            print(f"log_dir: {dep.log_dir}", flush=True)
            return dep

        code = run_until_signal(start, lambda dep: dep.shutdown())
        print("stopped", flush=True)
        return code
