"""The LoRA adapters the engines serve, as the gateway needs them: ``/v1/models`` lists them, and a request naming
one the engines lack is a 404 before anything starts (a stream included).

The router answers ``/v1/models`` itself (its one model), so the gateway asks an engine behind it: the router's
``GET /workers``, then SGLang's ``GET /v1/models`` of a healthy worker (each adapter card has a ``parent``). The
answer is kept ``TTL_S`` seconds and asked again when a request names an adapter not in it. Where no engine can be
asked (a gateway pointed straight at an engine, an engine that does not list them), nothing is checked here and the
engines' own refusal stands.
"""

from __future__ import annotations

import time

import httpx

from slime_server.gateway.engine_client import EngineClient
from slime_server.gateway.errors import APIError

TTL_S = 2.0


class AdapterDirectory:
    def __init__(self, engine: EngineClient, served_name: str) -> None:
        self.engine, self.served_name = engine, served_name
        self._names: set[str] | None = None
        self._at = -TTL_S

    async def names(self, refresh: bool = False) -> set[str] | None:
        """The adapters an engine serves now (None: no engine could be asked)."""
        if not refresh and time.monotonic() - self._at < TTL_S:
            return self._names
        self._names, self._at = await self._ask(), time.monotonic()
        return self._names

    async def _ask(self) -> set[str] | None:
        http = self.engine.http
        try:
            r = await http.get("/workers", timeout=5)
            if r.status_code != 200:
                return None
            workers = [w["url"] for w in r.json().get("workers", []) if w.get("is_healthy", True)]
            for url in workers:
                m = await http.get(f"{url.rstrip('/')}/v1/models", timeout=5)
                if m.status_code == 200:
                    return {card["id"] for card in m.json().get("data", []) if card.get("parent")}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return None

    async def check(self, adapter: str) -> None:
        """404 (``model_not_found``, param ``model``) when the engines are known not to serve ``adapter``."""
        names = await self.names()
        if names is not None and adapter not in names:
            names = await self.names(refresh=True)
        if names is not None and adapter not in names:
            raise APIError(404, f"the model '{self.served_name}:{adapter}' does not exist: the engines serve no LoRA "
                           f"adapter '{adapter}' (they serve: {', '.join(sorted(names)) or 'none'})",
                           code="model_not_found", param="model")
