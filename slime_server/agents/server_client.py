"""The agent runners' HTTP client of a slime-server's ``/v1``: models, sessions, completions, rewards, closes.

aiohttp, not httpx: a training process runs the gateway, the store and the runner of its episodes side by side,
and the runner's five calls per episode through httpx were a third of that process's CPU (py-spy, the demo's
calculator episodes: httpx's pool bookkeeping and response streams); aiohttp's C parser costs ~1 ms less a call
(gateway/engine_client.py measured it). One session per run, on the run's loop; the process's one TLS context.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from slime_server.utils.net import tls_context

JSON_BODY = {"Content-Type": "application/json"}


class Reply:
    """A finished response: status, headers and the whole body (read before the connection went back)."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status_code, self.headers, self.content = status, headers, body

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class HTTPStatusError(Exception):
    """The server refused a call (its status and error body)."""

    def __init__(self, reply: Reply) -> None:
        self.response = reply
        super().__init__(f"Error code: {reply.status_code} - {reply.text[:400]}")


TransportError = (aiohttp.ClientError, asyncio.TimeoutError)  # no answer: refused, dropped, timed out


class ServerClient:
    """Calls to one server with the runner's key. Make it inside the loop that uses it (aiohttp binds to it)."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {api_key}"},
            connector=aiohttp.TCPConnector(limit=0, ssl=tls_context()),  # episodes in flight never wait for a socket
            timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def request(self, method: str, path: str, body: Any = None,
                      headers: Mapping[str, str] | None = None) -> Reply:
        """One call; a transport failure raises one of ``TransportError``, any status comes back."""
        data = None if body is None else json.dumps(body).encode()
        async with self._session.request(method, self.base_url + path, data=data,
                                         headers={**JSON_BODY, **(headers or {})}) as r:
            return Reply(r.status, r.headers, await r.read())

    async def get_json(self, path: str) -> Any:
        reply = await self.request("GET", path)
        if reply.status_code >= 400:
            raise HTTPStatusError(reply)
        return reply.json()

    async def post_retrying(self, path: str, body: dict[str, Any], tries: int = 4) -> Reply:
        """POST that rides out a transient server failure (502/503/504, a dropped connection: a busy store,
        a restarting gateway) with backoff; the calls it is used for are harmless to repeat (a reward has its
        idempotency key, a close is idempotent, a session created twice is one empty session more)."""
        for attempt in range(tries):
            try:
                reply = await self.request("POST", path, body)
                if reply.status_code not in (502, 503, 504) or attempt == tries - 1:
                    if reply.status_code >= 400:
                        raise HTTPStatusError(reply)
                    return reply
            except TransportError:
                if attempt == tries - 1:
                    raise
            await asyncio.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._session.close()
