"""Generation calls that must reach an engine with every field: the gateway picks the engine itself.

Why: sgl-router 0.3.2 (the release on the package index) re-serialises ``/generate`` bodies through its own request
type, which has no ``return_routed_experts`` or ``routed_experts_start_len``: through it an engine started with
``--enable-return-routed-experts`` is never asked, and answers no routes (measured: the same body answers routes
from the engine and none through the router). While routes are recorded, calls go to one of the router's workers
(its ``GET /workers``, as the gateway's aborts already do), chosen by the session id's hash so a session's turns
meet their prefix cache; an engine that fails is passed over for ``AVOID_S`` and the caller's retries land on
another. A gateway pointed at one engine (no ``/workers``) calls that engine.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from slime_server.gateway.engine_client import EngineClient, EngineError
from slime_server.rollout.protocol import GenerateOutput

WORKERS_TTL_S = 2.0  # the router's worker list is read again after this long
AVOID_S = 10.0  # an engine that just failed is not picked again for this long (while others remain)


class DirectEngines:
    """Picks a worker per session and keeps one ``EngineClient`` per worker URL."""

    def __init__(self, router: EngineClient) -> None:
        self.router = router
        self._clients: dict[str, EngineClient] = {}
        self._urls: list[str] = []
        self._read_at = float("-inf")
        self._failed: dict[str, float] = {}

    async def _workers(self) -> list[str]:
        if time.monotonic() - self._read_at < WORKERS_TTL_S and self._urls:
            return self._urls
        try:
            r = await self.router.http.get(f"{self.router.base_url}/workers")
            urls = sorted(w["url"].rstrip("/") for w in r.json().get("workers", [])) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as e:
            raise EngineError(503, f"inference backend unreachable: {e!r}", code="engine_unavailable") from e
        self._urls = urls or [self.router.base_url]  # no worker list: the gateway was pointed at an engine
        self._read_at = time.monotonic()
        return self._urls

    async def pick(self, session_id: str) -> EngineClient:
        urls = await self._workers()
        now = time.monotonic()
        healthy = [u for u in urls if now - self._failed.get(u, float("-inf")) > AVOID_S] or urls
        url = healthy[zlib.crc32(session_id.encode()) % len(healthy)]
        if url not in self._clients:
            self._clients[url] = self.router.sibling(url)
        return self._clients[url]

    def _failing(self, client: EngineClient, e: EngineError) -> None:
        if e.status in (502, 503):
            self._failed[client.base_url] = time.monotonic()
            self._read_at = float("-inf")  # the router may have dropped it: read the list again

    def generate(self, session_id: str):
        """``EngineClient.generate`` on the session's engine."""
        async def call(input_ids: list[int], params: dict[str, Any], **kw: Any) -> list[GenerateOutput]:
            client = await self.pick(session_id)
            try:
                return await client.generate(input_ids, params, **kw)
            except EngineError as e:
                self._failing(client, e)
                raise
        return call

    def generate_stream(self, session_id: str):
        """``EngineClient.generate_stream`` on the session's engine."""
        async def call(input_ids: list[int], params: dict[str, Any], **kw: Any) -> AsyncIterator[GenerateOutput]:
            client = await self.pick(session_id)
            try:
                async for out in client.generate_stream(input_ids, params, **kw):
                    yield out
            except EngineError as e:
                self._failing(client, e)
                raise
        return call

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
