"""Durable job state in PostgreSQL: the same records and methods as ``job_store.SQLiteJobStore``.

Why: with the trajectories in a shared Postgres, a server's jobs (spec, state, last checkpoint,
metrics, events) belong in the same database, so whichever host runs the trainer after a restart
finds them there and one database is one thing to back up. Tables are created on open
(``IF NOT EXISTS``, under an advisory lock so replicas starting together do not race).
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg

from slime_server.buffer.job_store import EventRow, JobRow, MetricsRow
from slime_server.buffer.pg_conn import PgConnections

_LOCK = 0x5_11_3E_7A_0002
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL, state TEXT NOT NULL,
    error TEXT, created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS job_metrics (
    job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER NOT NULL, t DOUBLE PRECISION NOT NULL,
    metrics TEXT NOT NULL, PRIMARY KEY (job_id, step));
CREATE TABLE IF NOT EXISTS job_events (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, job_id TEXT NOT NULL REFERENCES jobs(id),
    t DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS job_events_job ON job_events (job_id, seq);
"""
_JOB_COLUMNS = "id, spec, status, state, error, created_at, updated_at"

Conn = psycopg.Connection[Any]


def _job(r: dict[str, Any]) -> JobRow:
    return JobRow(id=r["id"], spec=json.loads(r["spec"]), status=r["status"], state=json.loads(r["state"]),
                  error=r["error"], created_at=r["created_at"], updated_at=r["updated_at"])


class PostgresJobStore:
    """Jobs, metrics and events; every write is committed before it returns."""

    def __init__(self, url: str, *, pool_max: int = 4, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        self._db = PgConnections(url, max_size=pool_max, connect_timeout_s=connect_timeout_s)

        def create(conn: Conn) -> None:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
        try:
            self._db.write(create)
        except BaseException:
            self._db.close()
            raise

    # ---------------------------------------------------------------- jobs
    def insert_job(self, job_id: str, spec: dict[str, Any], status: str, state: dict[str, Any]) -> JobRow:
        t = time.time()
        self._db.write(lambda c: c.execute(
            "INSERT INTO jobs (id, spec, status, state, created_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s)",
            (job_id, json.dumps(spec), status, json.dumps(state), t, t)))
        return JobRow(id=job_id, spec=spec, status=status, state=state, created_at=t, updated_at=t)

    def update_job(self, job_id: str, *, status: str | None = None, state: dict[str, Any] | None = None,
                   error: str | None = None) -> None:
        sets, args = ["updated_at = %s"], [time.time()]
        if status is not None:
            sets.append("status = %s")
            args.append(status)
        if state is not None:
            sets.append("state = %s")
            args.append(json.dumps(state))
        if error is not None:
            sets.append("error = %s")
            args.append(error)
        self._db.write(lambda c: c.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = %s", (*args, job_id)))

    def get_job(self, job_id: str) -> JobRow | None:
        r = self._db.read(lambda c: c.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = %s", (job_id,)).fetchone())
        return _job(r) if r else None

    def list_jobs(self) -> list[JobRow]:
        rows = self._db.read(lambda c: c.execute(f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY created_at, id").fetchall())
        return [_job(r) for r in rows]

    # ---------------------------------------------------------------- metrics and events
    def add_metrics(self, job_id: str, step: int, metrics: dict[str, float]) -> None:
        self._db.write(lambda c: c.execute(
            "INSERT INTO job_metrics (job_id, step, t, metrics) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (job_id, step) DO UPDATE SET t = EXCLUDED.t, metrics = EXCLUDED.metrics",
            (job_id, step, time.time(), json.dumps(metrics))))

    def metrics(self, job_id: str, since_step: int = 0) -> list[MetricsRow]:
        rows = self._db.read(lambda c: c.execute(
            "SELECT step, t, metrics FROM job_metrics WHERE job_id = %s AND step > %s ORDER BY step",
            (job_id, since_step)).fetchall())
        return [MetricsRow(step=r["step"], t=r["t"], metrics=json.loads(r["metrics"])) for r in rows]

    def add_event(self, job_id: str, kind: str, data: dict[str, Any]) -> EventRow:
        t = time.time()
        seq = self._db.write(lambda c: c.execute(
            "INSERT INTO job_events (job_id, t, kind, data) VALUES (%s, %s, %s, %s) RETURNING seq",
            (job_id, t, kind, json.dumps(data, default=str))).fetchone()["seq"])
        return EventRow(seq=int(seq), t=t, kind=kind, data=data)

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRow]:
        rows = self._db.read(lambda c: c.execute(
            "SELECT seq, t, kind, data FROM job_events WHERE job_id = %s AND seq > %s ORDER BY seq",
            (job_id, after_seq)).fetchall())
        return [EventRow(seq=r["seq"], t=r["t"], kind=r["kind"], data=json.loads(r["data"])) for r in rows]

    def close(self) -> None:
        self._db.close()
