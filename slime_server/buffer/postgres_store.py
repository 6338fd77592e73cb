"""The stores on one PostgreSQL database shared by several gateway replicas (issue 8, item 4).

Why only constructors here: the trajectory, job and key stores are the same code on both databases
(``trajectory_store``, ``job_store``, ``key_store``); what Postgres adds is its connections
(``pg_conn.PostgresDatabase``: a pool, deadlock retries, lock timeouts, typed outages) and its
dialect (row locks, so replicas writing one session queue). psycopg is imported only here, when a
``postgresql://`` URL asks for it (``open.py``).

``url`` is a libpq URL (``postgresql://user:password@host:5432/db``); the database must exist and the
user must be allowed to create tables in it (the schema is created and migrated on open).
"""

from __future__ import annotations

from slime_server.buffer.adapter_store import AdapterStore
from slime_server.buffer.job_store import JobStore
from slime_server.buffer.key_store import KeyStore
from slime_server.buffer.pg_conn import PostgresDatabase
from slime_server.buffer.trajectory_store import SQLTrajectoryStore


class PostgresTrajectoryStore(SQLTrajectoryStore):
    """``TrajectoryStore`` over a PostgreSQL database; safe to share between threads, processes and hosts."""

    def __init__(self, url: str, *, pool_max: int = 8, timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 busy_timeout_s: float = 30.0) -> None:
        self.url = url  # deliberately not ``path``: callers that find ``path`` open SQLite files beside it
        super().__init__(PostgresDatabase(url, max_size=pool_max, timeout_s=timeout_s,
                                          connect_timeout_s=connect_timeout_s, lock_timeout_s=busy_timeout_s))


class PostgresJobStore(JobStore):
    def __init__(self, url: str, *, pool_max: int = 4, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        super().__init__(PostgresDatabase(url, max_size=pool_max, connect_timeout_s=connect_timeout_s))


class PostgresKeyStore(KeyStore):
    def __init__(self, url: str, *, pool_max: int = 4, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        super().__init__(PostgresDatabase(url, max_size=pool_max, connect_timeout_s=connect_timeout_s))


class PostgresAdapterStore(AdapterStore):
    def __init__(self, url: str, *, pool_max: int = 2, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        super().__init__(PostgresDatabase(url, max_size=pool_max, connect_timeout_s=connect_timeout_s))
