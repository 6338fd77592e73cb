"""Who is calling: a ``Principal`` (admin, agent or session key) and which sessions it may reach.

Why in the core: every turn checks the caller against the session it records into, without knowing
how the caller was authenticated (``api/auth.py`` turns a bearer token into a ``Principal``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from slime_server.gateway.errors import APIError

Role = Literal["admin", "agent", "session"]


@dataclass(frozen=True)
class Principal:
    role: Role = "admin"
    owner: str | None = None  # agents: the owner recorded on the sessions they create
    session_id: str | None = None  # session keys: the one session they reach

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def session_owner(self) -> str | None:
        """Owner to record on (and to require of) the sessions this caller's /v1 calls touch."""
        return self.owner if self.role == "agent" else None

    def may_access(self, session: Any) -> bool:
        if self.role == "admin":
            return True
        if self.role == "session":
            return session.id == self.session_id
        return getattr(session, "owner", None) == self.owner

    def check_session(self, session: Any) -> None:
        if not self.may_access(session):
            raise _forbidden()

    def check_session_id(self, session_id: str) -> None:
        """Early check for session keys, before any lookup (they cannot probe which ids exist)."""
        if self.role == "session" and session_id != self.session_id:
            raise _forbidden()

    def require_admin(self) -> None:
        if not self.is_admin:
            raise APIError(403, "this route needs an admin key", code="admin_required")

    def require_agent(self) -> None:
        """Admin or agent: anything but a session-bound key."""
        if self.role == "session":
            raise APIError(403, "a session API key cannot do this", code="admin_required")


def _forbidden() -> APIError:
    return APIError(403, "this API key cannot reach that session", code="session_forbidden")
