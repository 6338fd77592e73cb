"""Who is calling: admin, agent or one session's holder, from the bearer key (issue 9, "Access").

Roles, from most to least power:
- **admin**: everything (jobs, keys, export, dashboard controls, every session). The
  ``--admin-api-key``, minted admin keys, and ``--api-key`` when no admin key is set.
- **agent**: ``/v1`` calls, and the sessions it created (read, reward, close, abort, feedback).
  Minted agent keys (each owns its own sessions), ``--api-key`` when an admin key is set (owner
  ``api-key``), and, while no ``--api-key`` is set, callers without a key (owner ``anonymous``).
- **session**: one session only (AReaL style), ``sk-sess-<session_id>.<secret>``, for untrusted
  environment code that should reach nothing else.

Only hashes of minted and session keys are stored (``buffer/key_store.py``); the two configured
keys live in the operator's settings. Every comparison with a secret is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import Request

from slime_server.buffer.key_store import hash_secret, parse_key
from slime_server.config import SetupError
from slime_server.gateway.errors import APIError
from slime_server.gateway.principal import Principal
from slime_server.utils.net import is_loopback

SESSION_KEY_PREFIX = "sk-sess-"


class GatewayExposureError(SetupError):
    """The gateway would listen beyond loopback with no admin key: anyone who reaches it is admin."""


def check_bind(host: str, admin_api_key: str | None, insecure: bool) -> bool:
    """Refuse a gateway on a non-loopback ``host`` without an admin key unless ``insecure``; True when it
    will run exposed that way (the caller warns). Only the admin key counts: ``api_key`` is what agents hold."""
    if admin_api_key or is_loopback(host):
        return False
    if not insecure:
        raise GatewayExposureError(
            f"refusing to serve on {host} without an admin key: anyone who reaches the port could start jobs, "
            "mint keys and read every trajectory. Set gateway.admin_api_key (--admin-api-key or "
            "SLIME_GATEWAY__ADMIN_API_KEY), bind to 127.0.0.1, or pass --insecure-gateway to accept the risk")
    return True


def mint_session_key(session_id: str) -> tuple[str, str]:
    """A new key for ``session_id`` and the hash to store."""
    secret = secrets.token_urlsafe(24)
    return f"{SESSION_KEY_PREFIX}{session_id}.{secret}", hash_secret(secret)


def parse_session_key(token: str) -> tuple[str, str] | None:
    """(session_id, secret) of a session key, or None if ``token`` is not one."""
    if not token.startswith(SESSION_KEY_PREFIX):
        return None
    session_id, dot, secret = token[len(SESSION_KEY_PREFIX):].rpartition(".")
    if not dot or not session_id or not secret:
        return None
    return session_id, secret


def bearer_token(request: Request) -> str | None:
    """``Authorization: Bearer <key>`` (OpenAI clients), else ``x-api-key: <key>`` (Anthropic clients)."""
    header = request.headers.get("authorization")
    if not header:
        return request.headers.get("x-api-key", "").strip() or None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def reads_store(token: str | None) -> bool:
    """Whether ``authenticate`` reads the store for ``token`` (a minted or a session key's hash): the only case
    worth a thread; every other token is settled by comparisons in memory."""
    return token is not None and (parse_key(token) is not None or parse_session_key(token) is not None)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(hashlib.sha256(a.encode()).digest(), hashlib.sha256(b.encode()).digest())


def authenticate(token: str | None, *, api_key: str | None, admin_api_key: str | None,
                 session_key_hash: Callable[[str], str | None],
                 minted_key: Callable[[str], tuple[Any, str] | None] | None = None) -> Principal:
    """Resolve a bearer token to a principal, or raise 401.

    ``session_key_hash(session_id)`` gives a session's stored key hash; ``minted_key(key_id)`` a
    minted key's record and hash (``SQLiteKeyStore.lookup``). A well-formed session or minted key
    is always checked as such, so clients behave the same whether or not the API is open.
    """
    if token is not None:
        if admin_api_key is not None and _same(token, admin_api_key):
            return Principal()
        if api_key is not None and _same(token, api_key):
            return Principal() if admin_api_key is None else Principal(role="agent", owner="api-key")
        minted = parse_key(token)
        if minted is not None:
            found = minted_key(minted[0]) if minted_key is not None else None
            if found is None or found[0].revoked_at is not None or not _same(found[1], hash_secret(minted[1])):
                raise APIError(401, "invalid or revoked API key", code="invalid_api_key")
            record = found[0]
            if record.role == "admin":
                return Principal()
            return Principal(role="agent", owner=f"key:{record.id}", asserts_users=record.role == "frontend")
        parsed = parse_session_key(token)
        if parsed is not None:
            session_id, secret = parsed
            expected = session_key_hash(session_id)
            if expected and _same(expected, hash_secret(secret)):
                return Principal(role="session", session_id=session_id)
            raise APIError(401, "invalid session API key", code="invalid_api_key")
    if api_key is None:  # /v1 is open: the operator has not asked for keys
        return Principal() if admin_api_key is None else Principal(role="agent", owner="anonymous")
    raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                   code="invalid_api_key")
