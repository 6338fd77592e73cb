"""Durable job state: the job record, its metrics over time and its event log (SQLite, same file).

Why beside the trajectories: a restarted server must find its jobs, their last checkpoint and
their history where it finds the data they train on; one file is one thing to back up. Tables are
created on open (``IF NOT EXISTS``), so an existing trajectory database gains them in place.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from slime_server.buffer.sqlite_conn import ThreadConnections

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL, state TEXT NOT NULL,
    error TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS job_metrics (
    job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER NOT NULL, t REAL NOT NULL, metrics TEXT NOT NULL,
    PRIMARY KEY (job_id, step));
CREATE TABLE IF NOT EXISTS job_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL REFERENCES jobs(id), t REAL NOT NULL,
    kind TEXT NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS job_events_job ON job_events (job_id, seq);
"""


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


class SQLiteJobStore:
    """Jobs, metrics and events; every write is committed (``synchronous=FULL``) before it returns."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db = ThreadConnections(self.path)
        self._conn, self._tx = self._db.conn, self._db.write
        with self._tx() as conn:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)

    # ---------------------------------------------------------------- jobs
    def insert_job(self, job_id: str, spec: dict[str, Any], status: str, state: dict[str, Any]) -> JobRow:
        t = time.time()
        with self._tx() as conn:
            conn.execute("INSERT INTO jobs (id, spec, status, state, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                         (job_id, json.dumps(spec), status, json.dumps(state), t, t))
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
        with self._tx() as conn:
            conn.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))

    @staticmethod
    def _row(r: tuple) -> JobRow:
        return JobRow(id=r[0], spec=json.loads(r[1]), status=r[2], state=json.loads(r[3]), error=r[4],
                      created_at=r[5], updated_at=r[6])

    def get_job(self, job_id: str) -> JobRow | None:
        r = self._conn().execute("SELECT id, spec, status, state, error, created_at, updated_at FROM jobs "
                                 "WHERE id = ?", (job_id,)).fetchone()
        return self._row(r) if r else None

    def list_jobs(self) -> list[JobRow]:
        rows = self._conn().execute("SELECT id, spec, status, state, error, created_at, updated_at FROM jobs "
                                    "ORDER BY created_at").fetchall()
        return [self._row(r) for r in rows]

    # ---------------------------------------------------------------- metrics and events
    def add_metrics(self, job_id: str, step: int, metrics: dict[str, float]) -> None:
        with self._tx() as conn:
            conn.execute("INSERT OR REPLACE INTO job_metrics (job_id, step, t, metrics) VALUES (?, ?, ?, ?)",
                         (job_id, step, time.time(), json.dumps(metrics)))

    def metrics(self, job_id: str, since_step: int = 0) -> list[MetricsRow]:
        rows = self._conn().execute("SELECT step, t, metrics FROM job_metrics WHERE job_id = ? AND step > ? "
                                    "ORDER BY step", (job_id, since_step)).fetchall()
        return [MetricsRow(step=r[0], t=r[1], metrics=json.loads(r[2])) for r in rows]

    def add_event(self, job_id: str, kind: str, data: dict[str, Any]) -> EventRow:
        t = time.time()
        with self._tx() as conn:
            cur = conn.execute("INSERT INTO job_events (job_id, t, kind, data) VALUES (?, ?, ?, ?)",
                               (job_id, t, kind, json.dumps(data, default=str)))
            seq = int(cur.lastrowid or 0)
        return EventRow(seq=seq, t=t, kind=kind, data=data)

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRow]:
        rows = self._conn().execute("SELECT seq, t, kind, data FROM job_events WHERE job_id = ? AND seq > ? "
                                    "ORDER BY seq", (job_id, after_seq)).fetchall()
        return [EventRow(seq=r[0], t=r[1], kind=r[2], data=json.loads(r[3])) for r in rows]

    def close(self) -> None:
        self._db.close()
