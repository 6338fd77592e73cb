"""``build_gateway``: the gateway app wired to its parts (renderer, store, session manager), for ``serve``,
``slime-server gateway`` and the judge's own gateway alike."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from slime_server.api.app import create_app
from slime_server.buffer.open import open_store
from slime_server.config import GatewaySettings


def build_gateway(router_url: str, model_path: str | Path, settings: GatewaySettings,
                  engine_api_key: str | None = None) -> FastAPI:
    """Wire renderer, store (a SQLite file, or Postgres shared by replicas) and session manager into the app."""
    from slime_server.gateway.chat_template import ChatRenderer  # lazy: loads transformers
    from slime_server.gateway.sessions import SessionManager  # lazy: loads transformers

    renderer = ChatRenderer(model_path, tools_fallback=settings.tools_fallback)
    store = open_store(settings.db_path)
    sessions = SessionManager(store, renderer)
    name = settings.served_model_name or Path(model_path).name
    return create_app(router_url=router_url, renderer=renderer, sessions=sessions, store=store,
                      settings=settings, model_name=name, engine_api_key=engine_api_key)
