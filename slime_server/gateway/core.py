"""``Gateway``: the state every request handler shares (engine client, renderer, sessions, store, jobs),
and the two things it does beyond one route: pacing admission and the abortable engine call.

Why a module of its own: the routers and ``app.py`` both need it; kept apart from them, neither imports
the other (``app.py`` includes the routers; the routers depend on this and ``deps.py``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from slime_server.buffer.key_store import KeyStore
from slime_server.buffer.store import TrajectoryStore
from slime_server.config import GatewaySettings
from slime_server.gateway.adapters import AdapterDirectory
from slime_server.gateway.direct_engines import DirectEngines
from slime_server.gateway.engine_client import EngineClient
from slime_server.gateway.errors import APIError
from slime_server.gateway.pacing import Pacer
from slime_server.gateway.partial import (
    ENGINE_RETRIES,
    InflightRegistry,
    abort_everywhere,
    abort_resending,
    generate_continuing,
    sample_rids,
    stream_samples,
)
from slime_server.gateway.reasoning import ReasoningParser, get_reasoning_parser
from slime_server.gateway.threads import in_thread
from slime_server.gateway.tool_parsers import ToolCallParser, get_tool_parser
from slime_server.rollout.protocol import GenerateOutput

PARTIAL_CONTINUATIONS = Counter("slime_partial_rollout_continuations_total",
                                "engine-aborted generations the gateway continued (partial rollouts)")


@dataclass
class Gateway:
    """Everything a request handler needs; stored on ``app.state.gw``."""

    settings: GatewaySettings
    model_name: str
    engine: EngineClient
    renderer: Any  # slime_server.gateway.chat_template.ChatRenderer
    sessions: Any  # slime_server.gateway.sessions.SessionManager
    store: TrajectoryStore
    jobs: Any = None  # slime_server.jobs.manager.JobManager when a trainer is attached (serve); None: serving only
    feedback: Any = None  # slime_server.online.feedback.ImplicitFeedback with `serve --online`
    keys: KeyStore | None = None  # minted agent/admin keys
    inflight: InflightRegistry = field(default_factory=InflightRegistry)
    stored_images: OrderedDict[str, None] = field(default_factory=OrderedDict)  # image hashes this gateway stored
    checked_images: OrderedDict[str, tuple[str, int, int]] = field(default_factory=OrderedDict)  # gateway/images.py
    tool_parser: ToolCallParser = field(init=False)
    reasoning: ReasoningParser | None = field(init=False)
    pacer: Pacer = field(init=False)
    adapters: AdapterDirectory = field(init=False)
    direct: DirectEngines = field(init=False)  # calls that must reach an engine whole (recorded routes)

    def __post_init__(self) -> None:
        self.pacer = Pacer(self.store, lambda: self.jobs)
        self.direct = DirectEngines(self.engine)
        self.adapters = AdapterDirectory(self.engine, self.model_name)
        template = getattr(getattr(self.renderer, "tokenizer", None), "chat_template", None)
        self.tool_parser = get_tool_parser(self.settings.tool_parser, template if isinstance(template, str) else None)
        name = self.settings.reasoning_parser
        self.reasoning = get_reasoning_parser(name) if name else None

    def key_hash(self, session_id: str) -> str | None:
        session = self.store.get_session(session_id)
        return getattr(session, "key_hash", None) if session is not None else None

    async def admit(self, session_id: str | None, metadata: dict[str, str] | None) -> None:
        """Buffer pacing (``gateway/pacing.py``): 429 + Retry-After while a job's buffer is full.

        Serve-only traffic is never paced: a request with ``metadata.serve_only = "true"`` or a
        session opened with ``{"metadata": {"serve_only": true}}``; nor is a later turn of a session that
        already has one (an episode under way finishes).
        """
        if self.jobs is None or str((metadata or {}).get("serve_only", "")).lower() in ("true", "1", "yes"):
            return
        known, retry = self.pacer.cached()
        if not known:
            retry = await in_thread(self.pacer.retry_after)
        if retry is None or (session_id is not None and await in_thread(self._exempt, session_id)):
            return
        raise APIError(429, "the trajectory buffer is full: the trainer is behind; retry later",
                       code="buffer_full", headers={"Retry-After": str(max(1, round(retry)))})

    def _exempt(self, session_id: str) -> bool:
        """Serve-only sessions, and episodes already under way: pacing bounds new episodes only. Refusing the
        next turn of a started one would leave its group incomplete forever, and the trainer, which waits for
        complete groups, would never drain the buffer that refuses it (seen in CI: 70 buffered, 18 sessions
        mid-episode answered 429 for good)."""
        try:
            session = self.store.get_session(session_id)
        except LookupError:
            return False
        if session is None:
            return False
        return bool(session.metadata.get("serve_only")) or bool(self.store.get_trajectories(session_id))

    async def generate(self, session_id: str, rid: str, input_ids: list[int], params: dict[str, Any],
                       **kw: Any) -> list[Any]:
        """Engine call for a recorded turn: abortable per session, engine-side aborts continued.

        Every engine rid of this call is registered with the session before it is sent: the request's
        own (n = 1) or its samples' (n > 1: one engine request per sample, ``{rid}_{i}``) and each
        continuation's. An aborted rid whose request is still running is aborted again every second
        (the first abort may have reached the engine before the request)."""
        registered: list[str] = []

        def register(engine_rid: str) -> None:
            registered.append(engine_rid)
            self.inflight.add(session_id, engine_rid)

        async def abort(rids: list[str]) -> int:
            return await abort_everywhere(self.engine.base_url, rids, self.engine.http)

        route = kw.pop("route", None)  # a LoRA adapter's (gateway/adapters.py): re-sent when its version left
        generate = self.direct.generate(session_id) if kw.get("return_routed_experts") else self.engine.generate
        engine_call = self.adapters.unary(generate, route) if route is not None else generate
        try:
            outs, continued = await generate_continuing(
                abort_resending(engine_call, self.inflight.aborted, abort), input_ids, params, rid=rid,
                aborted_by_us=self.inflight.aborted, max_continuations=self.settings.max_continuations,
                register=register, token_bytes=self.renderer.token_bytes,
                engine_retries=self.settings.engine_retries, **kw)
        finally:
            for r in registered:
                self.inflight.done(session_id, r)
        if continued:
            PARTIAL_CONTINUATIONS.inc(continued)
        return outs

    async def generate_stream(self, session_id: str, rid: str, input_ids: list[int], params: dict[str, Any],
                              **kw: Any) -> AsyncIterator[GenerateOutput]:
        """Engine streams for a recorded streamed turn, abortable per session and continued after an engine-side
        abort or an engine failure as ``generate`` is (``partial.stream_samples``): every engine rid is
        registered with the session before it is sent."""
        registered = list(sample_rids(rid, int(params.get("n") or 1)))
        for r in registered:
            self.inflight.add(session_id, r)

        def register(engine_rid: str) -> None:
            registered.append(engine_rid)
            self.inflight.add(session_id, engine_rid)

        def counted(kind: str) -> None:
            (PARTIAL_CONTINUATIONS if kind == "continuation" else ENGINE_RETRIES).inc()

        async def abort(rids: list[str]) -> int:
            return await abort_everywhere(self.engine.base_url, rids, self.engine.http)

        route = kw.pop("route", None)
        stream = self.direct.generate_stream(session_id) if kw.get("return_routed_experts") \
            else self.engine.generate_stream
        engine_stream = self.adapters.streamed(stream, route) if route is not None else stream
        try:
            async for out in stream_samples(engine_stream, input_ids, params, rid,
                                            aborted=self.inflight.aborted, abort=abort, register=register,
                                            max_continuations=self.settings.max_continuations,
                                            engine_retries=self.settings.engine_retries,
                                            token_bytes=self.renderer.token_bytes, on_continue=counted, **kw):
                yield out
        finally:
            for r in registered:
                self.inflight.done(session_id, r)

    async def abort_session(self, session_id: str) -> dict[str, int]:
        """Abort every generation in flight for ``session_id`` on every engine (surplus rollouts)."""
        rids = self.inflight.mark_aborted(session_id)
        engines = await abort_everywhere(self.engine.base_url, rids, self.engine.http) if rids else 0
        return {"aborted": len(rids), "engines": engines}
