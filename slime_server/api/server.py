"""Run the gateway process: ``python -m slime_server.api.server --router-url URL --model-path P``.

Why its own entry point: ``slime-server serve`` starts engines + router and then this; tests and
benchmarks start it alone in front of an existing router or engine, and kill it (``kill -9``)
to prove that what was answered was already durable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from slime_server.api.app import create_app
from slime_server.api.auth import GatewayExposureError, check_bind
from slime_server.config import GatewaySettings
from slime_server.utils.logs import setup_logging


def build_gateway(router_url: str, model_path: str | Path, settings: GatewaySettings,
                  engine_api_key: str | None = None) -> FastAPI:
    """Wire renderer, store (a SQLite file, or Postgres shared by replicas) and session manager into the app."""
    from slime_server.api.chat_template import ChatRenderer
    from slime_server.buffer.open import open_store
    from slime_server.sessions import SessionManager

    renderer = ChatRenderer(model_path, tools_fallback=settings.tools_fallback)
    store = open_store(settings.db_path)
    sessions = SessionManager(store, renderer)
    name = settings.served_model_name or Path(model_path).name
    return create_app(router_url=router_url, renderer=renderer, sessions=sessions, store=store,
                      settings=settings, model_name=name, engine_api_key=engine_api_key)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--router-url", required=True, help="sgl-router (or one engine) speaking SGLang /generate")
    ap.add_argument("--model-path", required=True, help="HF model dir: tokenizer + chat template of the served model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--db-path", default="slime_server.db")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--admin-api-key", default=None)
    ap.add_argument("--insecure-gateway", action="store_true", help="serve beyond loopback with no admin key")
    ap.add_argument("--settings-json", default="{}", help="more GatewaySettings fields as JSON (limits, CORS, ...)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--tool-parser", default="auto", help="auto (from the chat template) | hermes | llama3_json | mistral")
    ap.add_argument("--reasoning-parser", default="qwen3", help='"" disables')
    ap.add_argument("--engine-supports-penalties", action="store_true")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--log-format", choices=("text", "json"), default="text")
    ap.add_argument("--online", action="store_true", help="implicit feedback: judge turns from the user's next one")
    ap.add_argument("--judge-url", default=None, help="judge /v1 (default: this gateway)")
    ap.add_argument("--judge-model", default=None)
    ap.add_argument("--judge-votes", type=int, default=1)
    ap.add_argument("--no-opd", action="store_true", help="do not score judge hints with the hinted teacher")
    a = ap.parse_args(argv)
    settings = GatewaySettings(**{
        "host": a.host, "port": a.port, "db_path": a.db_path, "api_key": a.api_key, "admin_api_key": a.admin_api_key,
        "served_model_name": a.served_model_name, "tool_parser": a.tool_parser,
        "reasoning_parser": a.reasoning_parser or None, "engine_supports_penalties": a.engine_supports_penalties,
        **json.loads(a.settings_json)})
    setup_logging(a.log_level, a.log_format)
    try:
        if check_bind(a.host, settings.admin_api_key, a.insecure_gateway or settings.insecure):
            logging.getLogger(__name__).warning("serving on %s with no admin key (--insecure-gateway)", a.host)
    except GatewayExposureError as e:
        raise SystemExit(f"error: {e}") from None
    # the engines' key (SGLang's --api-key; the router demands it too): the settings' env var, never a
    # flag that `ps` would show
    app = build_gateway(a.router_url, a.model_path, settings, engine_api_key=os.environ.get("SLIME_ENGINE__API_KEY"))
    if a.online:
        from slime_server.online.attach import attach_online
        from slime_server.online.feedback import OnlineSettings
        from slime_server.online.judge import JudgeSettings

        attach_online(app.state.gw, OnlineSettings(opd=not a.no_opd, judge=JudgeSettings(
            base_url=a.judge_url, model=a.judge_model, votes=a.judge_votes)), settings)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False)


if __name__ == "__main__":
    main()
