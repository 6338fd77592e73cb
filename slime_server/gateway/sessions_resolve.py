"""Which session a chat/completion call belongs to.

Order (first wins): the session a per-session API key is bound to; the ``X-Session-Id`` header;
``metadata.session_id`` in the body. A key-bound caller naming another session gets 403. A call
naming no session (None) becomes a one-turn session with a generated id, still recorded. A named
session that does not exist yet comes into being on first use (the session layer's
``get_or_create_session``), so an agent only has to set a header; a closed session is a 409.
The sessions REST endpoints, by contrast, answer 404 for an unknown id.
"""

from __future__ import annotations

from slime_server.gateway.errors import APIError, bad_request
from slime_server.gateway.principal import Principal

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID = 200


def resolve_session(principal: Principal, header_session_id: str | None,
                    metadata: dict[str, str] | None) -> str | None:
    named = header_session_id or (metadata or {}).get("session_id")
    if named is not None and (not named.strip() or len(named) > MAX_SESSION_ID):
        raise bad_request(f"session id must be 1..{MAX_SESSION_ID} characters", param="session_id")
    if principal.session_id is not None:
        if named and named != principal.session_id:
            raise APIError(403, "this API key is bound to another session", code="session_forbidden")
        return principal.session_id
    return named or None


def get_session_or_404(store, session_id: str):
    """The stored session, or a 404 in OpenAI error format."""
    try:
        return store.get_session(session_id)
    except LookupError:
        raise APIError(404, f"unknown session '{session_id}'", code="session_not_found",
                       param="session_id") from None
