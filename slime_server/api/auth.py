"""Bearer authentication for /v1: the server key (``--api-key``) and per-session keys.

Why per-session keys: an untrusted agent/environment can be handed a key that reaches only its
own session (its chat calls are recorded there, it can read/reward only that session), while the
operator's key reaches everything. A session key is ``sk-sess-<session_id>.<secret>``; only the
SHA-256 of the secret is stored, so a leaked database does not leak keys, and checking a key needs
no key->session index (the session id is in the key).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from fastapi import Request

from slime_server.api.errors import APIError

SESSION_KEY_PREFIX = "sk-sess-"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the operator (``session_id`` None) or the holder of one session's key."""

    session_id: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.session_id is None

    def check_session(self, session_id: str) -> None:
        if self.session_id is not None and self.session_id != session_id:
            raise APIError(403, "this API key is bound to another session", code="session_forbidden")

    def require_admin(self) -> None:
        if not self.is_admin:
            raise APIError(403, "a session API key cannot do this", code="admin_required")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


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
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def authenticate(token: str | None, api_key: str | None, stored_key_hash) -> Principal:
    """Resolve a bearer token. ``stored_key_hash(session_id)`` returns the stored hash or None.

    Without a server key the API is open (any token is the operator) except that a well-formed
    session key is always honoured as that session's key, so clients behave the same either way.
    """
    if token is not None and api_key is not None and hmac.compare_digest(token, api_key):
        return Principal()
    parsed = parse_session_key(token) if token else None
    if parsed is not None:
        session_id, secret = parsed
        expected = stored_key_hash(session_id)
        if expected and hmac.compare_digest(expected, hash_secret(secret)):
            return Principal(session_id=session_id)
        raise APIError(401, "invalid session API key", code="invalid_api_key")
    if api_key is None:
        return Principal()
    raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                   code="invalid_api_key")
