"""Open the right store for a ``gateway.db_path`` setting: a Postgres URL or a SQLite file path.

Why one place: the gateway, the job manager, the key store and the CLI commands all take the same
setting, and each must land on the same backend. ``postgresql://`` (or ``postgres://``) URLs open
the Postgres stores (several replicas share one database; needs the ``postgres`` extra); anything
else is a SQLite file. psycopg is imported only when a URL asks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slime_server.buffer.adapter_store import AdapterStore, SQLiteAdapterStore
from slime_server.buffer.job_store import JobStore, SQLiteJobStore
from slime_server.buffer.key_store import KeyStore, SQLiteKeyStore
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.buffer.store import TrajectoryStore


def is_postgres_url(url_or_path: str | Path) -> bool:
    return isinstance(url_or_path, str) and url_or_path.startswith(("postgresql://", "postgres://"))


def open_store(url_or_path: str | Path, **kwargs: Any) -> TrajectoryStore:
    """The trajectory store at ``url_or_path``; ``kwargs`` go to the store's constructor."""
    if is_postgres_url(url_or_path):
        from slime_server.buffer.postgres_store import PostgresTrajectoryStore  # lazy: loads psycopg

        return PostgresTrajectoryStore(str(url_or_path), **kwargs)
    return SQLiteTrajectoryStore(url_or_path, **kwargs)


def open_job_store(url_or_path: str | Path) -> JobStore:
    """The job store (``SQLiteJobStore`` or ``PostgresJobStore``) for ``url_or_path``."""
    if is_postgres_url(url_or_path):
        from slime_server.buffer.postgres_store import PostgresJobStore  # lazy: loads psycopg

        return PostgresJobStore(str(url_or_path))
    return SQLiteJobStore(url_or_path)


def open_key_store(url_or_path: str | Path) -> KeyStore:
    """The key store (``SQLiteKeyStore`` or ``PostgresKeyStore``) for ``url_or_path``."""
    if is_postgres_url(url_or_path):
        from slime_server.buffer.postgres_store import PostgresKeyStore  # lazy: loads psycopg

        return PostgresKeyStore(str(url_or_path))
    return SQLiteKeyStore(url_or_path)


def open_adapter_store(url_or_path: str | Path) -> AdapterStore:
    """The published-adapter store (``SQLiteAdapterStore`` or ``PostgresAdapterStore``) for ``url_or_path``."""
    if is_postgres_url(url_or_path):
        from slime_server.buffer.postgres_store import PostgresAdapterStore  # lazy: loads psycopg

        return PostgresAdapterStore(str(url_or_path))
    return SQLiteAdapterStore(url_or_path)
