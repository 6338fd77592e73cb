"""The CPU engine's API keys, exactly SGLang's (``sglang/srt/utils/auth.py``, 0.5.23).

Why SGLang's rule and not our own: every client of an engine (sgl-router, gateway, supervisor, trainer)
must work the same against SGLang on GPU and this engine on CPU, and anyone who reaches an engine's
port can otherwise swap the policy's weights or abort every rollout. So: ``--api-key`` guards every route
but health, readiness and metrics with ``Authorization: Bearer <key>``; the admin routes (weight updates,
pause/continue, abort, flush) take ``--admin-api-key`` when one is set (and then only it), else the API
key; a refusal is 401 ``{"error": "Unauthorized"}``. ``tests/test_sglang_contract.py`` checks the admin
route set against SGLang's own decorators.

The deployment side (``engine_key``, ``check_exposure``): one key per deployment, generated when engines
bind beyond loopback; an engine that would listen on the network with no key refuses to start unless the
user says ``--insecure-engines``.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from slime_server.config import SetupError
from slime_server.utils.net import is_loopback

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

# Our routes that SGLang marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)``; the rest are NORMAL.
ADMIN_ROUTES = frozenset({
    "/flush_cache", "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_tensor", "/update_weights_from_distributed", "/abort_request", "/pause_generation",
    "/continue_generation", "/load_lora_adapter", "/unload_lora_adapter",
    "/load_lora_adapter_from_tensors",
})
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # k8s probes and scrapers, never keyed (prefix match)
KEY_ENV = "SLIME_SERVER_ENGINE_KEY"  # how a CPU engine gets its key without showing it in `ps`


class InsecureEngineError(SetupError):
    """An engine would listen beyond loopback with no key: anyone on the network could swap its weights."""

    def __init__(self, host: str) -> None:
        super().__init__(
            f"refusing to start an engine on {host} without an API key: anyone who reaches it could replace the "
            "policy's weights or abort every rollout. Set engine.api_key (SLIME_ENGINE__API_KEY; `serve` and "
            "`engines` generate one for you), bind to 127.0.0.1, or pass --insecure-engines to accept the risk")


def check_exposure(host: str, api_key: str | None, insecure: bool) -> bool:
    """Raise InsecureEngineError for a keyless engine beyond loopback unless ``insecure``; True when the
    engine will run exposed (the caller logs a warning)."""
    if api_key or is_loopback(host):
        return False
    if not insecure:
        raise InsecureEngineError(host)
    return True


def engine_key(host: str, api_key: str | None, insecure: bool) -> str | None:
    """The deployment's engine key: the configured one; else a fresh random one when engines bind beyond
    loopback (unless ``insecure``); else None (loopback engines stay keyless, as SGLang's default)."""
    if api_key:
        return api_key
    if insecure or is_loopback(host):
        return None
    return secrets.token_urlsafe(32)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What every client of the engines (router, gateway, supervisor, trainer) sends: SGLang's Bearer header."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _bearer_is(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and bool(token) and secrets.compare_digest(token, key)


def request_allowed(method: str, path: str, authorization: str | None, api_key: str | None,
                    admin_api_key: str | None) -> bool:
    """SGLang's ``decide_request_auth`` for the NORMAL and ADMIN_OPTIONAL levels (we have no ADMIN_FORCE route)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_ROUTES:
        if admin_api_key:
            return _bearer_is(authorization, admin_api_key)
        return _bearer_is(authorization, api_key) if api_key else True
    return _bearer_is(authorization, api_key) if api_key else True


class ApiKeyMiddleware:
    """ASGI middleware (not ``BaseHTTPMiddleware``: a client that disconnects must still reach the route,
    which aborts its request, as SGLang's own middleware preserves)."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if not request_allowed(scope["method"], scope["path"], headers.get("authorization"), self.api_key,
                                   self.admin_api_key):
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Any) -> None:
    """SGLang's 401 (``JSONResponse({"error": "Unauthorized"})``), in raw ASGI: the gateway and the trainer
    import this module for ``auth_headers`` and need not load Starlette for it."""
    body = b'{"error":"Unauthorized"}'
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def add_api_keys(app: Any, api_key: str | None, admin_api_key: str | None) -> None:
    """Guard ``app`` with the keys (nothing changes when both are None)."""
    if api_key or admin_api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, admin_api_key=admin_api_key)
