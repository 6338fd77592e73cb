"""Published LoRA adapters: the alias a client names (``model: "<served>:<alias>"``) and the versioned adapter the
engines serve under it now, beside the trajectories so every gateway replica and a restarted server read the same.

Why aliases: stock SGLang cannot replace a loaded adapter in place (loading a loaded name fails; unloading first
leaves a gap where requests fail), so each update of an adapter is loaded under a new name
(``<alias>@<job>.v<version>``) and the alias moves to it in one committed write; the name it left is ``previous``,
unloaded once its requests have drained. ``version`` is the adapter's policy version, what the gateway records
for every token the adapter generates.
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from slime_server.buffer.migrations import migrated
from slime_server.buffer.sql import Database, Tx
from slime_server.buffer.sqlite_conn import SQLiteDatabase

USER_ALIAS_PREFIX = "user-"
_COLUMNS = "alias, name, version, job_id, previous, saved_version, saved_path, created_at, updated_at"


class PublishedAdapter(BaseModel):
    alias: str
    name: str  # the engines' name of the adapter the alias serves now
    version: int
    job_id: str | None = None
    previous: str | None = None  # the name the alias served before (being drained and unloaded)
    saved_version: int | None = None  # the newest version saved as a PEFT directory, and where
    saved_path: str | None = None

    @property
    def saved_name(self) -> str | None:
        """The engines' name of the saved version (None: nothing saved)."""
        return None if self.saved_version is None else versioned_name(self.alias, self.job_id, self.saved_version)
    created_at: float
    updated_at: float


def versioned_name(alias: str, job_id: str | None, version: int) -> str:
    """The engines' name of ``alias`` at ``version`` (a job's own: two jobs publishing one alias never collide)."""
    return f"{alias}@{job_id}.v{version}" if job_id and job_id != alias else f"{alias}.v{version}"


def user_alias(user: str) -> str:
    """The alias of ``user``'s own adapter in a per-user job (``lora.per = 'user'``): a digest, so neither the engines'
    adapter names nor the alias table spell out who the users are."""
    return USER_ALIAS_PREFIX + hashlib.sha256(user.encode()).hexdigest()[:20]


def is_user_alias(alias: str) -> bool:
    return re.fullmatch(rf"{USER_ALIAS_PREFIX}[0-9a-f]{{20}}", alias) is not None


def is_version_of(name: str, alias: str) -> bool:
    """Whether ``name`` is one of ``alias``'s versioned names (``versioned_name``)."""
    return re.fullmatch(rf"{re.escape(alias)}(@[^@]+)?\.v\d+", name) is not None


class AdapterStore:
    """Publish, look up, list and delete aliases over ``db``; each write committed before it returns."""

    def __init__(self, db: Database) -> None:
        self._db = migrated(db)

    def publish(self, alias: str, name: str, version: int, job_id: str | None = None) -> PublishedAdapter:
        """Point ``alias`` at ``name`` (version ``version``); the record after the write (``previous``: the name it
        pointed at before, None when it is new or unchanged)."""
        def run(tx: Tx) -> Any:
            t = time.time()
            row = tx.execute("SELECT name FROM lora_adapters WHERE alias = ?", (alias,)).fetchone()
            if row is None:
                tx.execute(f"INSERT INTO lora_adapters ({_COLUMNS}) VALUES (?, ?, ?, ?, NULL, NULL, NULL, ?, ?)",
                           (alias, name, version, job_id, t, t))
            else:
                previous = row["name"] if row["name"] != name else None
                tx.execute("UPDATE lora_adapters SET name = ?, version = ?, job_id = ?, previous = ?, updated_at = ? "
                           "WHERE alias = ?", (name, version, job_id, previous, t, alias))
            return tx.execute(f"SELECT {_COLUMNS} FROM lora_adapters WHERE alias = ?", (alias,)).fetchone()
        return _record(self._db.write(run))

    def saved(self, alias: str, version: int, path: str) -> None:
        """Version ``version`` of ``alias`` is saved as a PEFT directory at ``path`` (kept if newer than the last)."""
        self._db.write(lambda tx: tx.execute(
            "UPDATE lora_adapters SET saved_version = ?, saved_path = ?, updated_at = ? WHERE alias = ? AND "
            "(saved_version IS NULL OR saved_version <= ?)", (version, path, time.time(), alias, version)))

    def get(self, alias: str) -> PublishedAdapter | None:
        row = self._db.read(lambda tx: tx.execute(f"SELECT {_COLUMNS} FROM lora_adapters WHERE alias = ?",
                                                  (alias,)).fetchone())
        return None if row is None else _record(row)

    def list(self) -> list[PublishedAdapter]:
        rows = self._db.read(lambda tx: tx.execute(f"SELECT {_COLUMNS} FROM lora_adapters ORDER BY alias").fetchall())
        return [_record(r) for r in rows]

    def delete(self, alias: str) -> PublishedAdapter | None:
        def run(tx: Tx) -> Any:
            row = tx.execute(f"SELECT {_COLUMNS} FROM lora_adapters WHERE alias = ?", (alias,)).fetchone()
            tx.execute("DELETE FROM lora_adapters WHERE alias = ?", (alias,))
            return row
        row = self._db.write(run)
        return None if row is None else _record(row)

    def close(self) -> None:
        self._db.close()


class SQLiteAdapterStore(AdapterStore):
    def __init__(self, path: str | Path) -> None:
        super().__init__(SQLiteDatabase(str(path)))


def _record(row: Any) -> PublishedAdapter:
    return PublishedAdapter(alias=row["alias"], name=row["name"], version=int(row["version"]), job_id=row["job_id"],
                            previous=row["previous"], saved_version=row["saved_version"], saved_path=row["saved_path"],
                            created_at=row["created_at"], updated_at=row["updated_at"])
