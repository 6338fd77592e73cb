"""API keys minted by the server (agent and admin keys), stored as hashes beside the trajectories.

Why hashed: a copied database must not hand out access, so only SHA-256 of each key's secret is
kept (the secret is 32 random bytes: a fast hash is enough, no password stretching needed). A key
reads ``sk-slime-<key id>.<secret>``: the id finds the row without an index on secrets, the role
comes from the row, never from the key's text. Revoked keys stay listed (who had access, when).
"""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from slime_server.buffer.migrations import migrated
from slime_server.buffer.sql import Database, Tx
from slime_server.buffer.sqlite_conn import SQLiteDatabase

# frontend: an agent key that may also say, per call, which of its users it acts for (``X-Slime-User``)
KeyRole = Literal["agent", "admin", "frontend"]
KEY_PREFIX = "sk-slime-"

_COLUMNS = "id, role, name, key_hash, created_at, revoked_at"


class ApiKeyRecord(BaseModel):
    """A stored key without its secret: what listing keys shows."""

    id: str
    role: KeyRole
    name: str
    created_at: float
    revoked_at: float | None = None


class MintedKey(ApiKeyRecord):
    key: str  # shown once, at creation


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_key(token: str) -> tuple[str, str] | None:
    """(key id, secret) of a minted key, or None when ``token`` is not shaped like one."""
    if not token.startswith(KEY_PREFIX):
        return None
    key_id, dot, secret = token[len(KEY_PREFIX):].partition(".")
    return (key_id, secret) if dot and key_id and secret else None


class KeyStore:
    """Mint, verify, list and revoke keys over ``db``; each write committed before it returns. Lookups are
    not cached: a key revoked through one replica is refused by all of them at their next request."""

    def __init__(self, db: Database) -> None:
        self._db = migrated(db)

    def mint(self, role: KeyRole, name: str = "") -> MintedKey:
        key_id, secret = uuid.uuid4().hex[:16], secrets.token_urlsafe(32)
        record = ApiKeyRecord(id=key_id, role=role, name=name, created_at=time.time())
        self._db.write(lambda tx: tx.execute(
            "INSERT INTO api_keys (id, role, name, key_hash, created_at) VALUES (?, ?, ?, ?, ?)",
            (key_id, role, name, hash_secret(secret), record.created_at)))
        return MintedKey(**record.model_dump(), key=f"{KEY_PREFIX}{key_id}.{secret}")

    def lookup(self, key_id: str) -> tuple[ApiKeyRecord, str] | None:
        """The record and stored hash of ``key_id`` (revoked ones included), or None."""
        row = self._db.read(lambda tx: tx.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?",
                                                  (key_id,)).fetchone())
        return None if row is None else (_record(row), row["key_hash"])

    def list(self) -> list[ApiKeyRecord]:
        rows = self._db.read(lambda tx: tx.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, id")
                             .fetchall())
        return [_record(r) for r in rows]

    def revoke(self, key_id: str) -> ApiKeyRecord | None:
        def run(tx: Tx) -> Any:
            tx.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (time.time(), key_id))
            return tx.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        row = self._db.write(run)
        return _record(row) if row is not None else None

    def close(self) -> None:
        self._db.close()


class SQLiteKeyStore(KeyStore):
    def __init__(self, path: str | Path) -> None:
        super().__init__(SQLiteDatabase(str(path)))


def _record(row: Any) -> ApiKeyRecord:
    return ApiKeyRecord(id=row["id"], role=row["role"], name=row["name"], created_at=row["created_at"],
                        revoked_at=row["revoked_at"])
