"""The trajectory store on one SQLite file: the embedded default (WAL, fsync on every commit).

Why these settings (``sqlite_conn.SQLiteDatabase``): the gateway answers a request only after its turn
is committed (ARCHITECTURE decision 6), so ``synchronous=FULL`` makes a returned commit survive a
power cut; WAL lets the trainer read while the gateway writes; writes take the write lock up front
(``BEGIN IMMEDIATE``) so concurrent writers queue instead of failing half-way. The store itself is
``trajectory_store.SQLTrajectoryStore``, the same code as on PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path

from slime_server.buffer.sqlite_conn import SQLiteDatabase
from slime_server.buffer.trajectory_store import SQLTrajectoryStore


class SQLiteTrajectoryStore(SQLTrajectoryStore):
    """``TrajectoryStore`` over one SQLite file; safe to share between threads and processes."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = str(path)  # callers that find ``path`` keep their own files beside it
        super().__init__(SQLiteDatabase(self.path, busy_timeout_s=busy_timeout_s))
