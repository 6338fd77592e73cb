"""A judge served by this server on its own engines (``serve --online --judge-engine-model M``).

Why a separate deployment rather than the policy's own ``/v1``: the judge must not change while the
policy trains, and its traffic must not compete with users' requests on the policy engines nor
land in the policy's training buffer. So the judge model gets its own engines (Ray actors in the
same cluster) behind its own sgl-router, and a serve-only gateway on a loopback port that the
``Judge`` talks to like any OpenAI-compatible URL. Weight pushes only ever target the policy's
engines, so the judge stays at its initial weights. Its calls are recorded in a separate SQLite
file next to its logs (an audit trail of every verdict), never in the policy's store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_server.config import GatewaySettings, ServerSettings
from slime_server.server.gateway_thread import GatewayThread, bind_listener
from slime_server.server.launch import Deployment, ray_cpus_needed, resolve_model_path


@dataclass
class JudgeDeployment:
    deployment: Any  # slime_server.server.launch.Deployment
    gateway: Any  # slime_server.server.serve_cmd.GatewayThread
    base_url: str
    db_path: str

    def stop(self) -> None:
        try:
            self.gateway.stop()
        finally:
            self.deployment.shutdown()


def judge_server_settings(settings: ServerSettings, model: str, num_engines: int) -> ServerSettings:
    """The policy's settings with the judge's model and engine count, and a router of its own."""
    return settings.model_copy(update={
        # one thread each, anywhere: the judge's engines share the host with the policy's (server/core_share.py)
        "engine": settings.engine.model_copy(update={"model": model, "num_engines": num_engines,
                                                     "torch_threads": settings.engine.torch_threads or 1}),
        "router": settings.router.model_copy(update={"port": 0}),
    })


def with_judge_cpus(settings: ServerSettings, judge_engines: int) -> ServerSettings:
    """Reserve Ray CPUs for the judge's engines too, when this process starts the (local) cluster."""
    if settings.ray.address or judge_engines <= 0:
        return settings
    extra = judge_engines * settings.engine.num_cpus_per_engine
    base = settings.ray.num_cpus or max(os.cpu_count() or 1, ray_cpus_needed(settings))
    return settings.model_copy(update={"ray": settings.ray.model_copy(update={"num_cpus": int(base + extra + 0.999)})})


def start_judge_deployment(settings: ServerSettings, model: str, num_engines: int,
                           log_dir: str | Path | None) -> JudgeDeployment:
    """Engines + router + a loopback serve-only gateway for the judge; Ray must already be up."""
    from slime_server.server.build import build_gateway  # lazy: loads fastapi, starlette, torch

    if num_engines < 1:
        raise ValueError("the judge needs at least one engine")
    dep = Deployment.start(judge_server_settings(settings, model, num_engines),
                           log_dir=Path(log_dir) / "judge" if log_dir else None)
    listener = None
    try:
        listener = bind_listener("127.0.0.1", 0)
        port = int(listener.getsockname()[1])
        db_path = str(dep.log_dir / "judge_trajectories.db")
        app = build_gateway(dep.router_url, resolve_model_path(model),
                            GatewaySettings(host="127.0.0.1", port=port, db_path=db_path),
                            engine_api_key=dep.engine_api_key)
        gateway = GatewayThread(app, "127.0.0.1", port, listener).start()
    except BaseException:
        if listener is not None:
            listener.close()
        dep.shutdown()
        raise
    return JudgeDeployment(dep, gateway, f"http://127.0.0.1:{port}/v1", db_path)
