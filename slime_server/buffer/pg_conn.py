"""PostgreSQL as a ``sql.Database``: connections with the transaction discipline every store needs.

Why one helper (the counterpart of ``sqlite_conn.py``): the trajectory, job and key stores all
need the same three things. (1) Every write is one transaction committed before it returns, with
``synchronous_commit`` never ``off``, so an acknowledged turn survives a server crash. (2) Writes
from several gateway replicas are safe: callers lock what they read-modify-write (``SELECT ... FOR
UPDATE``), and a transaction that Postgres aborts as a deadlock or serialization failure is retried
from the start, so a caller sees either success or a typed error, never a half-applied write.
(3) A database that cannot serve (down, unreachable, full, read-only, lock wait timed out) surfaces
as ``StoreUnavailable`` (503 at the gateway) at once, after the rollback, and the next call after
it is back simply works.

Why a small pool of our own rather than ``psycopg_pool``: its background reconnects back off
exponentially, so after an outage requests kept failing for up to minutes after the database was
back, and while it was down each request waited the whole pool timeout before failing. Here a
request connects in its own thread when no idle connection is healthy, so "down" is an immediate
503 and "back" is the very next request. Idle connections are pinged on checkout (one round trip),
which is what makes a server restart invisible to callers.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from slime_server.buffer.schema import StoreUnavailable
from slime_server.buffer.sql import POSTGRES, Params, to_pyformat

T = TypeVar("T")
Conn = psycopg.Connection[Any]

_RETRIES = 8  # deadlock / serialization failure: Postgres aborted the whole transaction, run it again
_RETRYABLE = {"40001", "40P01"}  # serialization_failure, deadlock_detected (psycopg gives them no common base)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.Error) and exc.sqlstate in _RETRYABLE


def redact(url: str) -> str:
    """``url`` without its password (for error messages)."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://?"
    user = f"{info['user']}@" if info.get("user") else ""
    port = f":{info['port']}" if info.get("port") else ""
    return f"postgresql://{user}{info.get('host', '')}{port}/{info.get('dbname', '')}"


def unavailable(exc: BaseException, url: str) -> StoreUnavailable | None:
    """``StoreUnavailable`` for an error caused by the database's state rather than the request, else None."""
    if _retryable(exc):  # retried by ``PostgresDatabase``; still failing: busy
        return StoreUnavailable(f"the store at {redact(url)} is busy (transaction kept aborting): {exc}")
    if isinstance(exc, psycopg.OperationalError | pg_errors.ReadOnlySqlTransaction):
        return StoreUnavailable(f"the store at {redact(url)} is unavailable: {exc}")
    return None


class PgTx:
    """A connection that takes the stores' SQL (``?`` / ``:name`` parameters, ``sql.to_pyformat``)."""

    __slots__ = ("raw",)

    def __init__(self, raw: Conn) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Params | None = None) -> psycopg.Cursor[Any]:
        if params is None:
            return self.raw.execute(sql)  # type: ignore[arg-type]  # our own constant SQL
        return self.raw.execute(to_pyformat(sql), params)  # type: ignore[arg-type]


class PostgresDatabase:
    """At most ``max_size`` connections; ``write(fn)`` / ``read(fn)`` run ``fn(tx)`` on one of them."""

    dialect = POSTGRES

    def __init__(self, url: str, *, max_size: int = 8, timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 lock_timeout_s: float = 30.0) -> None:
        self.url = url
        self._timeout_s = timeout_s
        self._connect_timeout_s = max(2, int(connect_timeout_s))  # libpq rounds anything below 2 up to 2
        self._lock_timeout_ms = int(lock_timeout_s * 1000)
        self._slots = threading.BoundedSemaphore(max_size)
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        self.read(lambda conn: None)  # fail now, typed, on a bad URL or an unreachable server

    def _connect(self) -> Conn:
        conn = psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                               connect_timeout=self._connect_timeout_s)
        try:
            # A lock held by a stalled replica must not hang requests forever: wait at most lock_timeout
            # (the busy_timeout of the SQLite store), then fail as StoreUnavailable.
            conn.execute(f"SET lock_timeout = {self._lock_timeout_ms}")
            if conn.execute("SHOW synchronous_commit").fetchone()["synchronous_commit"] == "off":
                conn.execute("SET synchronous_commit = on")  # a returned commit must be on disk
        except BaseException:
            conn.close()
            raise
        return conn

    def _checkout(self) -> Conn:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect()
            try:
                conn.execute("")  # the server may have restarted since this connection was last used
                return conn
            except psycopg.Error:
                conn.close()

    def _checkin(self, conn: Conn) -> None:
        healthy = not conn.closed and not conn.broken and conn.info.transaction_status == pq.TransactionStatus.IDLE
        with self._lock:
            if healthy and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def _connection(self) -> Iterator[Conn]:
        if not self._slots.acquire(timeout=self._timeout_s):
            raise StoreUnavailable(f"the store at {redact(self.url)} is busy: no free connection "
                                   f"after {self._timeout_s:.0f} s")
        try:
            conn = self._checkout()
            try:
                yield conn
            finally:
                self._checkin(conn)
        finally:
            self._slots.release()

    def _run(self, fn: Callable[[PgTx], T], begin: str | None) -> T:
        """``begin`` None: no transaction (autocommit statements); else a transaction whose first statement it is."""
        for attempt in range(_RETRIES):
            try:
                with self._connection() as conn:
                    if begin is None:
                        return fn(PgTx(conn))
                    with conn.transaction():
                        if begin:
                            conn.execute(begin)  # type: ignore[arg-type]
                        return fn(PgTx(conn))
            except psycopg.Error as e:
                if not _retryable(e) or attempt == _RETRIES - 1:
                    raise
                time.sleep(random.uniform(0, 0.005 * 2**attempt))  # back off so the winner finishes
        raise AssertionError("unreachable")

    def _call(self, fn: Callable[[PgTx], T], begin: str | None) -> T:
        try:
            return self._run(fn, begin)
        except psycopg.Error as e:
            fault = unavailable(e, self.url)
            if fault is not None:
                raise fault from e
            raise

    def write(self, fn: Callable[[PgTx], T]) -> T:
        """Run ``fn`` in one read-write transaction, committed on return (run again whole on deadlock).

        If the connection breaks during COMMIT the outcome is unknown (as with any database): the
        caller gets ``StoreUnavailable`` and a retry of the same turn may then meet ``StaleWriteError``."""
        return self._call(fn, "")

    def read(self, fn: Callable[[PgTx], T], *, snapshot: bool = False) -> T:
        """Run ``fn``'s reads; ``snapshot``: all its statements see one snapshot (REPEATABLE READ).

        Without ``snapshot`` each statement runs on its own (autocommit): a READ COMMITTED transaction
        would give each statement its own snapshot anyway, and skipping BEGIN/COMMIT saves two round
        trips per read."""
        return self._call(fn, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY" if snapshot else None)

    def close(self) -> None:
        """Close idle connections; ones in use close when their call ends (a late call still works)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
