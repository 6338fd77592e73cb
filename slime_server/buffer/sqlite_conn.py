"""SQLite as a ``sql.Database``: per-thread connections with the durability settings every store needs.

Why one helper: the trajectory, job and key stores share a file and must agree on WAL,
``synchronous=FULL`` (a returned commit survives a power cut) and ``BEGIN IMMEDIATE`` writes
(concurrent writers queue instead of failing half-way). A disk that is full, read-only or failing
surfaces as ``StoreUnavailable`` (503 at the gateway) after the transaction is rolled back, so a
failed write leaves nothing half-written and the connection usable once the fault is gone.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from slime_server.buffer.schema import StoreError, StoreUnavailable
from slime_server.buffer.sql import SQLITE

T = TypeVar("T")
# The newest SQL the stores use: RETURNING (3.35); upserts (ON CONFLICT) came with 3.24.
_MIN_SQLITE = (3, 35, 0)

# Primary SQLite result codes that mean "the storage cannot serve this now", not "the request is wrong":
# BUSY (the busy timeout ran out), READONLY, IOERR, FULL, CANTOPEN.
_UNAVAILABLE = {5: "busy", 8: "read-only", 10: "failing (I/O error)", 13: "full", 14: "not openable"}


def unavailable(exc: BaseException) -> StoreUnavailable | None:
    """``StoreUnavailable`` for an sqlite3 error caused by the storage (disk full, read-only, ...), else None."""
    code = getattr(exc, "sqlite_errorcode", None)
    if not isinstance(exc, sqlite3.Error) or not isinstance(code, int) or (code & 0xFF) not in _UNAVAILABLE:
        return None
    return StoreUnavailable(f"the trajectory store is {_UNAVAILABLE[code & 0xFF]}: {exc}")


class SQLiteDatabase:
    """One file; ``write(fn)`` / ``read(fn)`` run ``fn`` on this thread's connection, in a transaction."""

    dialect = SQLITE

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise StoreError(f"SQLite {sqlite3.sqlite_version} is too old: the stores need "
                             f"{'.'.join(map(str, _MIN_SQLITE))} or newer (Python's sqlite3 module links it)")
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()

    def conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so nothing is committed implicitly.
        conn = None
        try:
            conn = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            return conn
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            _raise_unavailable(e)
            raise

    def write(self, fn: Callable[[Any], T]) -> T:
        """``fn(conn)`` in one transaction that holds the write lock from its start (``BEGIN IMMEDIATE``):
        concurrent writers queue instead of failing half-way; committed (fsync) before it returns."""
        conn = self.conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            result = fn(conn)
            conn.execute("COMMIT")
            return result
        except BaseException as e:
            _rollback(conn)
            _raise_unavailable(e)
            raise

    def read(self, fn: Callable[[Any], T], *, snapshot: bool = False) -> T:
        """``fn(conn)``'s reads in one transaction: SQLite gives them one snapshot whatever ``snapshot`` says."""
        conn = self.conn()
        try:
            conn.execute("BEGIN")
            try:
                return fn(conn)
            finally:
                conn.execute("COMMIT")
        except sqlite3.Error as e:
            _rollback(conn)
            _raise_unavailable(e)
            raise

    def close(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        self._local = threading.local()


def _raise_unavailable(exc: BaseException) -> None:
    fault = unavailable(exc)
    if fault is not None:
        raise fault from exc


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction, keeping the original error: SQLite may already have rolled it back
    itself (SQLITE_FULL does), and a failed COMMIT may leave it open (the next BEGIN would then fail)."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
