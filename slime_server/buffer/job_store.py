"""Durable job state: the job record, its metrics over time and its event log, beside the trajectories.

Why beside them (same SQLite file, or same Postgres database): a restarted server, on whichever host
runs the trainer next, must find its jobs, their last checkpoint and their history where it finds the
data they train on; one database is one thing to back up. The tables are part of the one schema
(``migrations.py``); the store is the same code on both databases (``sql.Database``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from slime_server.buffer.migrations import migrated
from slime_server.buffer.sql import Database, Tx
from slime_server.buffer.sqlite_conn import SQLiteDatabase

_JOB_COLUMNS = "id, spec, status, state, error, created_at, updated_at"


class JobRow(BaseModel):
    id: str
    spec: dict[str, Any]
    status: str
    state: dict[str, Any]
    error: str | None = None
    created_at: float
    updated_at: float


class MetricsRow(BaseModel):
    step: int
    t: float
    metrics: dict[str, float]


class EventRow(BaseModel):
    seq: int
    t: float
    kind: str
    data: dict[str, Any]


def _job(r: Any) -> JobRow:
    return JobRow(id=r["id"], spec=json.loads(r["spec"]), status=r["status"], state=json.loads(r["state"]),
                  error=r["error"], created_at=r["created_at"], updated_at=r["updated_at"])


class JobStore:
    """Jobs, metrics and events over ``db``; every write is committed before it returns."""

    def __init__(self, db: Database) -> None:
        self._db = migrated(db)

    # ---------------------------------------------------------------- jobs
    def insert_job(self, job_id: str, spec: dict[str, Any], status: str, state: dict[str, Any]) -> JobRow:
        t = time.time()
        self._db.write(lambda tx: tx.execute(
            "INSERT INTO jobs (id, spec, status, state, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
            (job_id, json.dumps(spec), status, json.dumps(state), t, t)))
        return JobRow(id=job_id, spec=spec, status=status, state=state, created_at=t, updated_at=t)

    def update_job(self, job_id: str, *, status: str | None = None, state: dict[str, Any] | None = None,
                   error: str | None = None) -> None:
        sets, args = ["updated_at = ?"], [time.time()]
        if status is not None:
            sets.append("status = ?")
            args.append(status)
        if state is not None:
            sets.append("state = ?")
            args.append(json.dumps(state))
        if error is not None:
            sets.append("error = ?")
            args.append(error)
        self._db.write(lambda tx: tx.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id)))

    def get_job(self, job_id: str) -> JobRow | None:
        r = self._db.read(lambda tx: tx.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone())
        return _job(r) if r else None

    def list_jobs(self) -> list[JobRow]:
        rows = self._db.read(lambda tx: tx.execute(f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY created_at, id")
                             .fetchall())
        return [_job(r) for r in rows]

    # ---------------------------------------------------------------- metrics and events
    def add_metrics(self, job_id: str, step: int, metrics: dict[str, float]) -> None:
        """A step's metrics; a replayed step (after a restart) replaces what the lost run wrote."""
        self._db.write(lambda tx: tx.execute(
            "INSERT INTO job_metrics (job_id, step, t, metrics) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (job_id, step) DO UPDATE SET t = excluded.t, metrics = excluded.metrics",
            (job_id, step, time.time(), json.dumps(metrics))))

    def metrics(self, job_id: str, since_step: int = 0) -> list[MetricsRow]:
        rows = self._db.read(lambda tx: tx.execute(
            "SELECT step, t, metrics FROM job_metrics WHERE job_id = ? AND step > ? ORDER BY step",
            (job_id, since_step)).fetchall())
        return [MetricsRow(step=r["step"], t=r["t"], metrics=json.loads(r["metrics"])) for r in rows]

    def add_event(self, job_id: str, kind: str, data: dict[str, Any]) -> EventRow:
        t = time.time()

        def run(tx: Tx) -> int:
            return int(tx.execute("INSERT INTO job_events (job_id, t, kind, data) VALUES (?, ?, ?, ?) RETURNING seq",
                                  (job_id, t, kind, json.dumps(data, default=str))).fetchone()["seq"])
        return EventRow(seq=self._db.write(run), t=t, kind=kind, data=data)

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRow]:
        rows = self._db.read(lambda tx: tx.execute(
            "SELECT seq, t, kind, data FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq",
            (job_id, after_seq)).fetchall())
        return [EventRow(seq=r["seq"], t=r["t"], kind=r["kind"], data=json.loads(r["data"])) for r in rows]

    def close(self) -> None:
        self._db.close()


class SQLiteJobStore(JobStore):
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        super().__init__(SQLiteDatabase(self.path))
