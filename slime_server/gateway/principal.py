"""Who is calling: a ``Principal`` (admin, agent or session key) and which sessions it may reach.

Why in the core: every turn checks the caller against the session it records into, without knowing
how the caller was authenticated (``api/auth.py`` turns a bearer token into a ``Principal``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from slime_server.gateway.errors import APIError

Role = Literal["admin", "agent", "session"]
USER_HEADER = "X-Slime-User"  # a trusted front end's user of the call (api/deps.py)
_USER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$")


@dataclass(frozen=True)
class Principal:
    role: Role = "admin"
    owner: str | None = None  # agents: the owner recorded on the sessions they create
    session_id: str | None = None  # session keys: the one session they reach
    asserts_users: bool = False  # a front end's key: it may say which of its users a call is for

    @property
    def user(self) -> str | None:
        """The user a call is recorded for, what per-user learning keys on: a minted agent key's owner
        (``key:<id>``), or a front end's user (``key:<front end>/<user>``); None for the admin, session keys and the
        shared configured key or open access (many people behind one name)."""
        return self.owner if self.role == "agent" and (self.owner or "").startswith("key:") else None

    def acting_for(self, user: str) -> Principal:
        """This front end's principal for one call made for ``user``: its sessions are that user's alone (they are
        owned by ``key:<front end>/<user>``). Any other key may not name a user: a 403."""
        if not self.asserts_users:
            raise APIError(403, f"this API key cannot name the user of a call ({USER_HEADER} needs a frontend key)",
                           code="user_header_forbidden", param=USER_HEADER)
        if not _USER.match(user):
            raise APIError(400, f"{USER_HEADER} must be 1-128 of letters, digits and . _ @ + - (starting with a "
                           "letter or digit)", code="invalid_value", param=USER_HEADER)
        return replace(self, owner=f"{self.owner}/{user}", asserts_users=False)

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
