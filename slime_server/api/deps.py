"""FastAPI dependencies every router shares: the gateway, the caller's principal, the admin guard."""

from __future__ import annotations

from fastapi import Depends, Request

from slime_server.api.auth import authenticate, bearer_token
from slime_server.gateway.core import Gateway
from slime_server.gateway.principal import Principal


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


Admin = Depends(require_admin)
