"""``slime-server gateway``: the gateway alone, in front of an sgl-router (or one engine) that already runs.

Why a command of its own: ``serve`` starts engines and a router, then the gateway in its own process;
tests and benchmarks start the gateway alone and ``kill -9`` it to prove that what was answered was
already durable, and gateway replicas over one Postgres store run it behind a load balancer. Its
settings are the tree's ``gateway`` section like every other command's (the flags below,
``SLIME_GATEWAY__*``, ``--config`` YAML); the engines' key is ``engine.api_key``
(``SLIME_ENGINE__API_KEY``), never a flag that ``ps`` would show.
"""

from __future__ import annotations

import argparse
import logging

from slime_server.api.auth import check_bind
from slime_server.config import GatewaySettings, ServerSettings, SetupError
from slime_server.online.attach import attach_online
from slime_server.online.preset import feedback_settings
from slime_server.server.build import build_gateway

log = logging.getLogger(__name__)

# flag -> gateway settings field; a flag left out leaves the setting to env / YAML / default
GATEWAY_FLAGS = {"host": "--host", "port": "--port", "api_key": "--api-key", "admin_api_key": "--admin-api-key",
                 "db_path": "--db-path", "served_model_name": "--served-model-name"}


class GatewayCommand:
    help = "run the gateway alone in front of a running sgl-router (or one engine), recording trajectories"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--router-url", required=True, help="sgl-router (or one engine) speaking SGLang /generate")
        parser.add_argument("--model-path", required=True,
                            help="HF model dir: the tokenizer and chat template of the served model")
        g = parser.add_argument_group("gateway settings (override SLIME_GATEWAY__* and --config)")
        g.add_argument("--host", default=None, help="sets gateway.host")
        g.add_argument("--port", type=int, default=None, help="sets gateway.port")
        g.add_argument("--api-key", default=None, help="sets gateway.api_key")
        g.add_argument("--admin-api-key", default=None, help="sets gateway.admin_api_key")
        g.add_argument("--db-path", default=None, help="sets gateway.db_path (a SQLite file or a postgresql:// URL)")
        g.add_argument("--served-model-name", default=None, help="sets gateway.served_model_name")
        # online learning: the settings' online section (--online, --judge-url, --judge-model, --judge-votes,
        # --opd-weight 0 to leave hints unscored); the live job and the judge's own engines are serve's

    def run(self, args: argparse.Namespace, settings: ServerSettings) -> int:
        import uvicorn

        if settings.online.enabled and settings.online.judge_engine_model is not None:
            raise SetupError("online.judge_engine_model is serve's (the gateway alone starts no engines): "
                             "give the judge's URL (--judge-url) instead")
        overrides = {field: getattr(args, field) for field in GATEWAY_FLAGS if getattr(args, field) is not None}
        gw = GatewaySettings.model_validate({**settings.gateway.model_dump(), **overrides})
        if check_bind(gw.host, gw.admin_api_key, gw.insecure):  # raises (exit 2) unless insecure
            log.warning("serving on %s with no admin key (--insecure-gateway)", gw.host)
        app = build_gateway(args.router_url, args.model_path, gw, engine_api_key=settings.engine.api_key)
        if settings.online.enabled:
            attach_online(app.state.gw, feedback_settings(settings.online), gw)
        uvicorn.run(app, host=gw.host, port=gw.port, log_level=settings.log.level, access_log=False)
        return 0
