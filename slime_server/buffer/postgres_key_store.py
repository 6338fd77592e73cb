"""Minted API keys in PostgreSQL: the same hashed records as ``key_store.SQLiteKeyStore``.

Why: gateway replicas sharing one Postgres must accept the same keys; a key minted through one
replica (or ``slime-server keys create``) works on all of them at once, and revoking it anywhere
revokes it everywhere on the next request (lookups are not cached). Only SHA-256 hashes are stored.
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any

import psycopg

from slime_server.buffer.key_store import KEY_PREFIX, ApiKeyRecord, KeyRole, MintedKey, hash_secret
from slime_server.buffer.pg_conn import PgConnections

_LOCK = 0x5_11_3E_7A_0003
_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, role TEXT NOT NULL, name TEXT NOT NULL, key_hash TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, revoked_at DOUBLE PRECISION)
"""
_COLUMNS = "id, role, name, key_hash, created_at, revoked_at"

Conn = psycopg.Connection[Any]


def _record(row: dict[str, Any]) -> ApiKeyRecord:
    return ApiKeyRecord(id=row["id"], role=row["role"], name=row["name"], created_at=row["created_at"],
                        revoked_at=row["revoked_at"])


class PostgresKeyStore:
    """Mint, verify, list and revoke keys; each write committed before it returns."""

    def __init__(self, url: str, *, pool_max: int = 4, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        self._db = PgConnections(url, max_size=pool_max, connect_timeout_s=connect_timeout_s)

        def create(conn: Conn) -> None:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
            conn.execute(_SCHEMA)
        try:
            self._db.write(create)
        except BaseException:
            self._db.close()
            raise

    def mint(self, role: KeyRole, name: str = "") -> MintedKey:
        key_id, secret = uuid.uuid4().hex[:16], secrets.token_urlsafe(32)
        record = ApiKeyRecord(id=key_id, role=role, name=name, created_at=time.time())
        self._db.write(lambda c: c.execute(
            "INSERT INTO api_keys (id, role, name, key_hash, created_at) VALUES (%s, %s, %s, %s, %s)",
            (key_id, role, name, hash_secret(secret), record.created_at)))
        return MintedKey(**record.model_dump(), key=f"{KEY_PREFIX}{key_id}.{secret}")

    def lookup(self, key_id: str) -> tuple[ApiKeyRecord, str] | None:
        """The record and stored hash of ``key_id`` (revoked ones included), or None."""
        row = self._db.read(lambda c: c.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = %s",
                                                (key_id,)).fetchone())
        return None if row is None else (_record(row), row["key_hash"])

    def list(self) -> list[ApiKeyRecord]:
        rows = self._db.read(lambda c: c.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, id").fetchall())
        return [_record(r) for r in rows]

    def revoke(self, key_id: str) -> ApiKeyRecord | None:
        def run(conn: Conn) -> dict[str, Any] | None:
            conn.execute("UPDATE api_keys SET revoked_at = %s WHERE id = %s AND revoked_at IS NULL",
                         (time.time(), key_id))
            return conn.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = %s", (key_id,)).fetchone()
        row = self._db.write(run)
        return _record(row) if row is not None else None

    def close(self) -> None:
        self._db.close()
