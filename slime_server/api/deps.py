"""FastAPI dependencies every router shares: the gateway, the caller's principal, the admin guard.

Why they are ``async``: FastAPI runs a plain ``def`` dependency on its thread pool, a thread hop per
dependency per request (two on every ``/v1`` call: ~8% of the gateway's Python time under
``tools/bench_gateway.py``). Only a key that must be looked up in the store leaves the event loop."""

from __future__ import annotations

from fastapi import Depends, Request

from slime_server.api.auth import authenticate, bearer_token, reads_store
from slime_server.gateway.core import Gateway
from slime_server.gateway.principal import USER_HEADER, Principal
from slime_server.gateway.threads import in_thread


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gw


async def get_gateway(request: Request) -> Gateway:
    return gateway_of(request)


async def get_principal(request: Request) -> Principal:
    gw = gateway_of(request)
    token = bearer_token(request)

    def resolve() -> Principal:
        return authenticate(token, api_key=gw.settings.api_key, admin_api_key=gw.settings.admin_api_key,
                            session_key_hash=_safe_key_hash(gw), minted_key=gw.keys.lookup if gw.keys else None)

    principal = await in_thread(resolve) if reads_store(token) else resolve()
    user = request.headers.get(USER_HEADER)
    return principal if user is None else principal.acting_for(user.strip())


async def require_admin(request: Request) -> None:
    """Route dependency: admin keys only (jobs, keys, export, dashboard controls)."""
    (await get_principal(request)).require_admin()


def _safe_key_hash(gw: Gateway):
    def lookup(session_id: str) -> str | None:
        try:
            return gw.key_hash(session_id)
        except LookupError:
            return None
    return lookup


Admin = Depends(require_admin)
