"""The SQL the stores speak, and the few places SQLite and PostgreSQL differ.

Why a dialect layer of our own rather than an ORM: the stores are a dozen statements each, written
once in the SQL both databases accept (``ON CONFLICT``, ``RETURNING``, ``CASE``, ``CAST``); what
differs is small and named here: column types, row locks (Postgres replicas write at once, SQLite
serialises every writer on its file lock, so its locks are empty), the NULL-safe comparison, and
the parameter style, which the Postgres connection translates (statements are written with ``?``
and ``:name``, SQLite's own).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
Params = Sequence[Any] | Mapping[str, Any]


@dataclass(frozen=True)
class Dialect:
    name: str
    ddl: Mapping[str, str]  # the names migrations write in braces: {real}, {blob}, {serial}, ...
    for_update: str  # after a SELECT that reads a row to change it: held until commit
    skip_locked: str  # after a SELECT of rows to change that others may be changing: skip those
    null_safe_eq: str  # a = b that is true for NULL = NULL
    insert_order: str  # the column that grows with every insert on the feedback table
    schema_lock: str  # first statement of a migration: replicas starting together migrate one at a time


SQLITE = Dialect(
    name="sqlite",
    ddl={"real": "REAL", "blob": "BLOB", "serial": "INTEGER PRIMARY KEY AUTOINCREMENT",
         "feedback_seq": "", "feedback_index": "response_id"},
    for_update="", skip_locked="", null_safe_eq="IS", insert_order="rowid",
    schema_lock="")  # a write transaction (BEGIN IMMEDIATE) already holds the file's only write lock

POSTGRES = Dialect(
    name="postgres",
    ddl={"real": "DOUBLE PRECISION", "blob": "BYTEA", "serial": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
         "feedback_seq": "seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,",
         "feedback_index": "response_id, created_at, seq"},
    for_update=" FOR UPDATE", skip_locked=" FOR UPDATE SKIP LOCKED", null_safe_eq="IS NOT DISTINCT FROM",
    insert_order="seq", schema_lock="SELECT pg_advisory_xact_lock(5571620765697)")  # 0x5113E7A0001, ours


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Tx(Protocol):
    """One transaction's connection: rows come back indexable by column name."""

    def execute(self, sql: str, params: Params | None = None) -> Cursor: ...


class Database(Protocol):
    """A backend's connections: ``write`` runs ``fn`` in one transaction committed before it returns;
    ``read`` runs reads (``snapshot``: all of them see one snapshot)."""

    dialect: Dialect

    def write(self, fn: Callable[[Tx], T]) -> T: ...

    def read(self, fn: Callable[[Tx], T], *, snapshot: bool = False) -> T: ...

    def close(self) -> None: ...


def placeholders(n: int) -> str:
    """``(?, ?, ...)`` for an ``IN`` list of ``n`` values (``n`` >= 1)."""
    return "(" + ", ".join("?" * n) + ")"


_PARAM = re.compile(r"\?|%|(?<![:\w]):([A-Za-z_]\w*)")


@lru_cache(maxsize=512)
def to_pyformat(sql: str) -> str:
    """SQLite's ``?`` / ``:name`` parameters as psycopg's ``%s`` / ``%(name)s`` (a literal ``%`` doubled)."""
    def sub(m: re.Match[str]) -> str:
        token = m.group(0)
        return "%s" if token == "?" else "%%" if token == "%" else f"%({m.group(1)})s"
    return _PARAM.sub(sub, sql)
