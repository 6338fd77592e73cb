"""``create_app(...)``: the OpenAI-compatible gateway as a FastAPI application.

Why a factory taking ready-made parts (renderer, session manager, store, router URL): tests and
``slime-server serve`` wire the same app, and each part is owned and tested by its own module.
The app itself only translates between the OpenAI protocol and SGLang's token-level protocol and
records every call through the session manager before answering (ARCHITECTURE decisions 2, 3, 6).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import Counter

from slime_server.api.access_log import AccessLogMiddleware
from slime_server.api.auth import Principal, authenticate, bearer_token
from slime_server.api.engine_client import EngineClient
from slime_server.api.errors import APIError, BodySizeLimitMiddleware, install_error_handlers
from slime_server.api.partial import InflightRegistry
from slime_server.api.reasoning import ReasoningParser, get_reasoning_parser
from slime_server.api.tool_parsers import ToolCallParser, get_tool_parser
from slime_server.config import GatewaySettings

PARTIAL_CONTINUATIONS = Counter("slime_partial_rollout_continuations_total",
                                "engine-aborted generations the gateway continued (partial rollouts)")


@dataclass
class Gateway:
    """Everything a request handler needs; stored on ``app.state.gw``."""

    settings: GatewaySettings
    model_name: str
    engine: EngineClient
    renderer: Any  # slime_server.api.chat_template.ChatRenderer
    sessions: Any  # slime_server.sessions.SessionManager
    store: Any  # slime_server.buffer.store.TrajectoryStore
    jobs: Any = None  # slime_server.jobs.JobManager when a trainer is attached (serve); None: serving only
    feedback: Any = None  # slime_server.online.feedback.ImplicitFeedback with `serve --online`
    keys: Any = None  # slime_server.buffer.key_store.SQLiteKeyStore: minted agent/admin keys
    inflight: InflightRegistry = field(default_factory=InflightRegistry)
    tool_parser: ToolCallParser = field(init=False)
    reasoning: ReasoningParser | None = field(init=False)

    def __post_init__(self) -> None:
        template = getattr(getattr(self.renderer, "tokenizer", None), "chat_template", None)
        self.tool_parser = get_tool_parser(self.settings.tool_parser, template if isinstance(template, str) else None)
        name = self.settings.reasoning_parser
        self.reasoning = get_reasoning_parser(name) if name else None

    def key_hash(self, session_id: str) -> str | None:
        session = self.store.get_session(session_id)
        return getattr(session, "key_hash", None) if session is not None else None


    async def admit(self, session_id: str | None, metadata: dict[str, str] | None) -> None:
        """Buffer pacing (ARCHITECTURE decision 7): 429 + Retry-After while a job's buffer is full.

        Serve-only traffic is never paced: a request with ``metadata.serve_only = "true"`` or a
        session opened with ``{"metadata": {"serve_only": true}}``.
        """
        if self.jobs is None or str((metadata or {}).get("serve_only", "")).lower() in ("true", "1", "yes"):
            return
        from starlette.concurrency import run_in_threadpool

        retry = await run_in_threadpool(self.jobs.retry_after, False)
        if retry is None or (session_id is not None and await run_in_threadpool(self._serve_only, session_id)):
            return
        raise APIError(429, "the trajectory buffer is full: the trainer is behind; retry later",
                       code="buffer_full", headers={"Retry-After": str(max(1, round(retry)))})

    def _serve_only(self, session_id: str) -> bool:
        try:
            session = self.store.get_session(session_id)
        except LookupError:
            return False
        return bool(session.metadata.get("serve_only"))


    async def generate(self, session_id: str, rid: str, input_ids: list[int], params: dict[str, Any],
                       **kw: Any) -> list[Any]:
        """Engine call for a recorded turn: abortable per session, engine-side aborts continued.

        Every engine rid of this call is registered with the session before it is sent: the request's
        own (n = 1) or its samples' (n > 1: one engine request per sample, ``{rid}_{i}``) and each
        continuation's. An aborted rid whose request is still running is aborted again every second
        (the first abort may have reached the engine before the request)."""
        from slime_server.api.partial import abort_everywhere, abort_resending, generate_continuing

        registered: list[str] = []

        def register(engine_rid: str) -> None:
            registered.append(engine_rid)
            self.inflight.add(session_id, engine_rid)

        async def abort(rids: list[str]) -> int:
            return await abort_everywhere(self.engine.base_url, rids, self.engine.http)

        try:
            outs, continued = await generate_continuing(
                abort_resending(self.engine.generate, self.inflight.aborted, abort), input_ids, params, rid=rid,
                aborted_by_us=self.inflight.aborted, max_continuations=self.settings.max_continuations,
                register=register, token_bytes=self.renderer.token_bytes, **kw)
        finally:
            for r in registered:
                self.inflight.done(session_id, r)
        if continued:
            PARTIAL_CONTINUATIONS.inc(continued)
        return outs

    async def abort_session(self, session_id: str) -> dict[str, int]:
        """Abort every generation in flight for ``session_id`` on every engine (surplus rollouts)."""
        from slime_server.api.partial import abort_everywhere

        rids = self.inflight.mark_aborted(session_id)
        engines = await abort_everywhere(self.engine.base_url, rids, self.engine.http) if rids else 0
        return {"aborted": len(rids), "engines": engines}


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gw


def get_principal(request: Request) -> Principal:
    gw = get_gateway(request)
    return authenticate(bearer_token(request), api_key=gw.settings.api_key, admin_api_key=gw.settings.admin_api_key,
                        session_key_hash=_safe_key_hash(gw), minted_key=gw.keys.lookup if gw.keys else None)


def require_admin(request: Request) -> None:
    """Route dependency: admin keys only (jobs, keys, export, dashboard controls)."""
    get_principal(request).require_admin()


def _safe_key_hash(gw: Gateway):
    def lookup(session_id: str) -> str | None:
        try:
            return gw.key_hash(session_id)
        except LookupError:
            return None
    return lookup


def create_app(*, router_url: str, renderer: Any, sessions: Any, store: Any,
               settings: GatewaySettings | None = None, model_name: str | None = None,
               engine_api_key: str | None = None) -> FastAPI:
    """Build the gateway app over a router (or a single engine) speaking SGLang's ``/generate``;
    ``engine_api_key`` is the deployment's engine key, which the router demands too."""
    from slime_server.api import dashboard, routes_admin, routes_jobs, routes_openai, routes_sessions

    settings = settings or GatewaySettings()
    name = model_name or settings.served_model_name or "default"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await app.state.gw.engine.aclose()

    app = FastAPI(title="slime-server gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over sgl-router; every call is recorded token-exactly.")
    app.state.gw = Gateway(settings=settings, model_name=name,
                           engine=EngineClient(router_url, timeout=settings.engine_timeout_s, api_key=engine_api_key),
                           renderer=renderer, sessions=sessions, store=store)
    source = getattr(store, "url", None) or getattr(store, "path", None)
    if source:  # minted keys live beside the trajectories (same SQLite file or Postgres database)
        from slime_server.buffer.open import open_key_store

        app.state.gw.keys = open_key_store(source)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AccessLogMiddleware)
    if settings.cors_origins:  # off unless asked for: browsers on other origins cannot call the API
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.include_router(routes_openai.router)
    app.include_router(routes_sessions.router)
    app.include_router(routes_jobs.router)
    app.include_router(routes_admin.router)
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
