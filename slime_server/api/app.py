"""``create_app(...)``: the OpenAI-compatible gateway as a FastAPI application.

Why a factory taking ready-made parts (renderer, session manager, store, router URL): tests and
``slime-server serve`` wire the same app, and each part is owned and tested by its own module.
The app itself only translates between the OpenAI protocol and SGLang's token-level protocol and
records every call through the session manager before answering (ARCHITECTURE decisions 2, 3, 6).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response

from slime_server.api import (
    dashboard,
    routes_adapters,
    routes_admin,
    routes_anthropic,
    routes_jobs,
    routes_openai,
    routes_responses,
    routes_sessions,
)
from slime_server.api.access_log import AccessLogMiddleware
from slime_server.api.errors import BodySizeLimitMiddleware, install_error_handlers
from slime_server.buffer.open import open_adapter_store, open_key_store
from slime_server.config import GatewaySettings
from slime_server.gateway.core import Gateway
from slime_server.gateway.engine_client import EngineClient
from slime_server.gateway.session_expiry import IdleSessionSweeper


def create_app(*, router_url: str, renderer: Any, sessions: Any, store: Any,
               settings: GatewaySettings | None = None, model_name: str | None = None,
               engine_api_key: str | None = None) -> FastAPI:
    """Build the gateway app over a router (or a single engine) speaking SGLang's ``/generate``;
    ``engine_api_key`` is the deployment's engine key, which the router demands too."""
    settings = settings or GatewaySettings()
    name = model_name or settings.served_model_name or "default"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sweeper = None
        if settings.session_idle_timeout_s is not None:
            sweeper = asyncio.create_task(IdleSessionSweeper(store, settings.session_idle_timeout_s).run())
        yield
        if sweeper is not None:
            sweeper.cancel()
        await app.state.gw.engine.aclose()
        await app.state.gw.direct.aclose()

    app = FastAPI(title="slime-server gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over sgl-router; every call is recorded token-exactly.")
    app.state.gw = Gateway(settings=settings, model_name=name,
                           engine=EngineClient(router_url, timeout=settings.engine_timeout_s, api_key=engine_api_key),
                           renderer=renderer, sessions=sessions, store=store)
    source = getattr(store, "url", None) or getattr(store, "path", None)
    if source:  # minted keys live beside the trajectories (same SQLite file or Postgres database)

        app.state.gw.keys = open_key_store(source)
        app.state.gw.adapters.aliases = open_adapter_store(source)  # published adapters' aliases, likewise
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AccessLogMiddleware)
    if settings.cors_origins:  # off unless asked for: browsers on other origins cannot call the API
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.include_router(routes_openai.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_anthropic.router)
    app.include_router(routes_sessions.router)
    app.include_router(routes_jobs.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_adapters.router)
    app.include_router(dashboard.router)  # /dashboard: static page (no auth) + admin JSON API

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus text format: serving (sessions, segment splits, admission) and training gauges."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
