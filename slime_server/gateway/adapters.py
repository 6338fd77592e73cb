"""The LoRA adapters the engines serve, as the gateway needs them: ``/v1/models`` lists them, and a request naming
one the engines lack is a 404 before anything starts (a stream included).

A name may be an alias a job published (``buffer/adapter_store.py``): it routes to the versioned adapter the alias
points at now, and every token that adapter generates is recorded with the adapter's version. A request routed to
a version that is being unloaded (the alias moved on meanwhile: another replica, a stale cache) is sent again under
the alias's current version before anything was answered, so an update never fails a request.

The router answers ``/v1/models`` itself (its one model), so the gateway asks an engine behind it: the router's
``GET /workers``, then SGLang's ``GET /v1/models`` of a healthy worker (each adapter card has a ``parent``). The
answer is kept ``TTL_S`` seconds and asked again when a request names an adapter not in it. Where no engine can be
asked (a gateway pointed straight at an engine, an engine that does not list them), nothing is checked here and the
engines' own refusal stands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from slime_server.buffer.adapter_store import (
    AdapterStore,
    PublishedAdapter,
    is_user_alias,
    is_version_of,
    user_alias,
)
from slime_server.gateway.engine_client import EngineClient, EngineError
from slime_server.gateway.errors import APIError
from slime_server.gateway.principal import Principal
from slime_server.gateway.threads import in_thread
from slime_server.rollout.adapter_staging import path_for_engine, unstage_for_engine
from slime_server.rollout.protocol import GenerateOutput

log = logging.getLogger(__name__)
TTL_S = 2.0
ALIAS_TTL_S = 1.0  # how long a replica routes by an alias it read (the trainer unloads a left version later)
ALIASES_KEPT = 100_000  # aliases (and users' misses) remembered; the cache starts over beyond this
RESENDS = 3  # re-sends of one request after its version was unloaded (each one to the alias's newer version)


@dataclass
class AdapterRoute:
    """Where one request's adapter goes: ``name`` on the engines; ``version`` the published alias's (None: an
    adapter loaded by name, whose tokens keep the engine's ``weight_version``)."""

    requested: str
    name: str
    version: int | None = None

    def stamp(self, out: GenerateOutput) -> GenerateOutput:
        if self.version is not None:  # the adapter is the policy: its version is every token's version
            out.meta_info.weight_version = str(self.version)
            out.meta_info.weight_versions = None
        return out


class AdapterDirectory:
    def __init__(self, engine: EngineClient, served_name: str) -> None:
        self.engine, self.served_name = engine, served_name
        self.aliases: AdapterStore | None = None  # published aliases (set where the gateway has a store)
        self._names: set[str] | None = None
        self._at = -TTL_S
        self._alias_cache: dict[str, tuple[float, PublishedAdapter | None]] = {}

    async def published(self, alias: str, refresh: bool = False, keep_miss: bool = False) -> PublishedAdapter | None:
        """``alias``'s record (None: no such alias), read again after ``ALIAS_TTL_S``. A miss is kept only with
        ``keep_miss`` (a user's own alias, looked up on every call of theirs): otherwise an alias published a
        moment later is found at once."""
        if self.aliases is None:
            return None
        hit = self._alias_cache.get(alias)
        if hit is not None and not refresh and time.monotonic() - hit[0] < ALIAS_TTL_S:
            return hit[1]
        record = await in_thread(self.aliases.get, alias)
        if record is not None or keep_miss:
            if len(self._alias_cache) >= ALIASES_KEPT:
                self._alias_cache.clear()
            self._alias_cache[alias] = (time.monotonic(), record)
        return record

    async def for_call(self, requested: str | None, principal: Principal) -> AdapterRoute | None:
        """Where one call goes: the adapter it names (a user's own adapter only by that user or the admin), or, when
        it names the served model, the caller's own adapter once a per-user job has published one (None: the
        base). A user whose adapter the engines cannot serve now is served by the base, not refused."""
        if requested is not None:
            mine = principal.user is not None and user_alias(principal.user) == requested
            if is_user_alias(requested) and not (mine or principal.is_admin):
                raise APIError(404, f"the model '{self.served_name}:{requested}' does not exist",
                               code="model_not_found", param="model")
            return await self.route(requested)
        if principal.user is None:
            return None
        alias = user_alias(principal.user)
        if await self.published(alias, keep_miss=True) is None:
            return None
        try:
            return await self.route(alias)
        except APIError as e:
            log.warning("user adapter %s not served (%s): the base answers", alias, e.message)
            return None

    async def listing(self) -> list[str]:
        """What clients can name: every published alias, then the engines' adapters that are no alias's version."""
        names = await self.names() or set()
        records = await in_thread(self.aliases.list) if self.aliases is not None else []
        shown = {n for n in names if not any(is_version_of(n, r.alias) for r in records)}
        return sorted({r.alias for r in records if not is_user_alias(r.alias)} | shown)

    async def route(self, requested: str) -> AdapterRoute:
        """The route of a request naming ``requested`` (an alias or an engine's adapter name); a 404 now when the
        engines are known not to serve it."""
        record = await self.published(requested)
        if record is None:
            await self.check(requested)
            return AdapterRoute(requested, requested)
        route = AdapterRoute(requested, record.name, record.version)
        try:
            await self.check(route.name, shown=requested)
        except APIError:
            if await self._moved(route):  # read the alias before the engines' list: it may have moved since
                await self.check(route.name, shown=requested)
                return route
            saved = await self._load_saved(record)  # the engines lost it (restarted): its saved version, loaded
            if saved is None:
                raise
            await self.check(saved.name, shown=requested)
            return saved
        return route

    async def unload_versions(self, alias: str) -> list[str]:
        """Unload every version of ``alias`` from every engine behind the router (each waits for its requests);
        the names unloaded."""
        gone: set[str] = set()
        for url in await self._workers():
            for name in await self._served_by(url) or []:
                if is_version_of(name, alias):
                    await self.engine.http.post(f"{url}/unload_lora_adapter", json={"lora_name": name}, timeout=600)
                    await in_thread(unstage_for_engine, httpx.URL(url).host, name)
                    gone.add(name)
        self._at = -TTL_S  # the engines' list changed
        self._alias_cache.pop(alias, None)
        return sorted(gone)

    async def _load_saved(self, record: PublishedAdapter) -> AdapterRoute | None:
        """Load the alias's newest saved version into every engine behind the router (SGLang's
        ``/load_lora_adapter``; one that has it is fine) and route there; None when nothing is saved or a load
        failed. The alias itself stays: its job (if it runs) publishes newer versions."""
        if record.saved_path is None or record.saved_name is None:
            return None
        try:
            urls = await self._workers()
            for url in urls:
                if not await self._load_saved_into(url, record.saved_name, record.saved_path):
                    return None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, OSError, RuntimeError):
            return None
        if not urls:
            return None
        self._at = -TTL_S  # the engines' list changed
        return AdapterRoute(record.alias, record.saved_name, record.saved_version)

    async def _load_saved_into(self, url: str, name: str, path: str) -> bool:
        """``/load_lora_adapter`` of a saved version into one engine (one that has it is fine); an engine on another
        host gets the directory's files on its own disk first (rollout/adapter_staging.py: this process must be in
        the engines' Ray cluster, as ``serve`` is)."""
        # a staged copy is kept until the version is unloaded: an engine reloads from it
        path = await in_thread(path_for_engine, httpx.URL(url).host, name, path)
        answer = await self.engine.http.post(f"{url}/load_lora_adapter", timeout=300,
                                             json={"lora_name": name, "lora_path": path})
        return answer.status_code == 200 or "already loaded" in answer.text

    async def _moved(self, route: AdapterRoute) -> bool:
        """True when the alias of ``route`` points elsewhere now (``route`` updated to it)."""
        if route.version is None:
            return False
        record = await self.published(route.requested, refresh=True)
        if record is None or record.name == route.name:
            return False
        route.name, route.version = record.name, record.version
        return True

    def unary(self, fn: Callable[..., Awaitable[list[GenerateOutput]]], route: AdapterRoute
              ) -> Callable[..., Awaitable[list[GenerateOutput]]]:
        """``fn`` (the engine's ``generate``) sent to ``route``'s adapter, re-sent when its version left."""
        async def call(*args: Any, **kw: Any) -> list[GenerateOutput]:
            for attempt in range(RESENDS + 1):
                try:
                    outs = await fn(*args, **{**kw, "lora_path": route.name})
                except EngineError as e:
                    if e.status != 404 or attempt == RESENDS or not await self._moved(route):
                        raise
                    continue
                return [route.stamp(o) for o in outs]
            raise AssertionError("unreachable")
        return call

    def streamed(self, fn: Callable[..., AsyncIterator[GenerateOutput]], route: AdapterRoute
                 ) -> Callable[..., AsyncIterator[GenerateOutput]]:
        """``fn`` (the engine's ``generate_stream``) likewise: re-sent only while nothing has been yielded."""
        async def call(*args: Any, **kw: Any) -> AsyncIterator[GenerateOutput]:
            for attempt in range(RESENDS + 1):
                started = False
                try:
                    async for out in fn(*args, **{**kw, "lora_path": route.name}):
                        started = True
                        yield route.stamp(out)
                    return
                except EngineError as e:
                    if started or e.status != 404 or attempt == RESENDS or not await self._moved(route):
                        raise
        return call

    async def names(self, refresh: bool = False) -> set[str] | None:
        """The adapters an engine serves now (None: no engine could be asked)."""
        if not refresh and time.monotonic() - self._at < TTL_S:
            return self._names
        self._names, self._at = await self._ask(), time.monotonic()
        return self._names

    async def _ask(self) -> set[str] | None:
        try:
            for url in await self._workers(healthy_only=True):
                served = await self._served_by(url)
                if served is not None:
                    return set(served)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return None

    async def _workers(self, healthy_only: bool = False) -> list[str]:
        """The engines behind the router (its ``GET /workers``; none when it does not say)."""
        r = await self.engine.http.get("/workers", timeout=5)
        if r.status_code != 200:
            return []
        return [w["url"].rstrip("/") for w in r.json().get("workers", [])
                if not healthy_only or w.get("is_healthy", True)]

    async def _served_by(self, url: str) -> list[str] | None:
        """The adapters engine ``url`` lists in SGLang's ``/v1/models`` (cards with a parent); None: no answer."""
        m = await self.engine.http.get(f"{url}/v1/models", timeout=5)
        return [c["id"] for c in m.json().get("data", []) if c.get("parent")] if m.status_code == 200 else None

    async def check(self, adapter: str, shown: str | None = None) -> None:
        """404 (``model_not_found``, param ``model``) when the engines are known not to serve ``adapter``."""
        names = await self.names()
        if names is not None and adapter not in names:
            names = await self.names(refresh=True)
        if names is not None and adapter not in names:
            shown = shown or adapter
            raise APIError(404, f"the model '{self.served_name}:{shown}' does not exist: the engines serve no LoRA "
                           f"adapter '{adapter}' (they serve: {', '.join(sorted(names)) or 'none'})",
                           code="model_not_found", param="model")
