"""The SQLite trajectory store: the contract (``tests/_store_contract.py``) on a file, and what only a file
has: WAL, a reopen, a writer killed mid-write, a database from before schema version 6."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime_server.buffer.schema import StoreError
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from tests._store_contract import StoreContract

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path: Path):
    s = SQLiteTrajectoryStore(tmp_path / "buffer.db")
    yield s
    s.close()


class TestSQLiteStore(StoreContract):
    """The store's contract (``tests/_store_contract.py``) on a SQLite file."""


def test_schema_is_versioned_and_reopen_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    s = SQLiteTrajectoryStore(path)
    s.create_session("keep")
    s.close()
    s2 = SQLiteTrajectoryStore(path)
    assert s2.schema_version() == SQLiteTrajectoryStore.SCHEMA_VERSION
    assert s2.get_session("keep").id == "keep"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0] == SQLiteTrajectoryStore.SCHEMA_VERSION
    conn.execute("INSERT INTO schema_migrations VALUES (999, 0)")
    conn.commit()
    conn.close()
    s2.close()
    with pytest.raises(StoreError, match="newer"):
        SQLiteTrajectoryStore(path)


_WRITER = textwrap.dedent("""
    import sys, time
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.buffer.schema import Trajectory, Turn
    from slime_server.buffer.store import ResponseRef, TurnWrite
    store = SQLiteTrajectoryStore(sys.argv[1])
    store.create_session("durable")
    logprobs = [-(i + 1) / 7 for i in range(50)]
    t = Trajectory(session_id="durable", tokens=list(range(53)), loss_mask=[0] * 3 + [1] * 50,
                   rollout_logprobs=[0.0] * 3 + logprobs, weight_versions=[-1] * 3 + [2] * 50,
                   turns=[Turn(response_id="chatcmpl-d", prompt_start=0, output_start=3, output_end=53)])
    store.write_turn(TurnWrite(session_id="durable", trajectories=[t],
                               responses=[ResponseRef(response_id="chatcmpl-d", choice=0, trajectory_id=t.id)]))
    print("COMMITTED", t.id, flush=True)
    while True:  # keep writing other sessions until killed, so the kill lands mid-activity
        store.create_session()
""")


def test_committed_turn_survives_kill_9(tmp_path: Path) -> None:
    db = tmp_path / "durable.db"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("COMMITTED"), line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    store = SQLiteTrajectoryStore(db)
    try:
        assert store.integrity_check() == "ok"
        [traj] = store.get_trajectories("durable")
        assert traj.id == line.split()[1]
        assert traj.rollout_logprobs[3:] == [-(i + 1) / 7 for i in range(50)]
        assert store.find_by_response_id("chatcmpl-d")[0][0].id == traj.id
    finally:
        store.close()


def test_a_database_written_before_jobs_and_keys_were_versioned_opens_and_keeps_them(tmp_path: Path) -> None:
    """Schema version 6 folded the job and key tables (which their stores used to create on open) into the
    one migration list: a database from before, with those tables and rows in it, opens at version 6 with
    every row kept, whichever store opens it first."""
    from slime_server.buffer.job_store import SQLiteJobStore
    from slime_server.buffer.key_store import SQLiteKeyStore
    from slime_server.buffer.migrations import MIGRATIONS
    from slime_server.buffer.sql import SQLITE

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    for version, migration in enumerate(MIGRATIONS[:5], 1):
        conn.executescript(migration.format_map(SQLITE.ddl))
        conn.execute("INSERT INTO schema_migrations VALUES (?, 0)", (version,))
    conn.executescript("""  -- the job and key stores' own tables, as they created them on open before version 6
        CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL,
            state TEXT NOT NULL, error TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE IF NOT EXISTS job_metrics (job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER NOT NULL,
            t REAL NOT NULL, metrics TEXT NOT NULL, PRIMARY KEY (job_id, step));
        CREATE TABLE IF NOT EXISTS job_events (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL
            REFERENCES jobs(id), t REAL NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL);
        CREATE TABLE IF NOT EXISTS api_keys (id TEXT PRIMARY KEY, role TEXT NOT NULL, name TEXT NOT NULL,
            key_hash TEXT NOT NULL, created_at REAL NOT NULL, revoked_at REAL);
        INSERT INTO jobs VALUES ('job-old', '{}', 'done', '{"step": 7}', NULL, 1.0, 2.0);
        INSERT INTO job_events (job_id, t, kind, data) VALUES ('job-old', 1.5, 'step', '{}');
        INSERT INTO api_keys VALUES ('k1', 'agent', 'bot', 'h', 1.0, NULL);
        INSERT INTO sessions (id, metadata, status, created_at, updated_at) VALUES ('s-old', '{}', 'open', 1, 1);
    """)
    conn.commit()
    conn.close()
    jobs = SQLiteJobStore(path)  # the job store opens it first, as `serve` does after the trajectory store
    try:
        assert jobs.get_job("job-old").state == {"step": 7}
        assert [e.seq for e in jobs.events("job-old")] == [1] and jobs.add_event("job-old", "x", {}).seq == 2
    finally:
        jobs.close()
    keys, store = SQLiteKeyStore(path), SQLiteTrajectoryStore(path)
    try:
        assert [k.id for k in keys.list()] == ["k1"]
        assert store.schema_version() == SQLiteTrajectoryStore.SCHEMA_VERSION and store.get_session("s-old").status == "open"
        assert store.integrity_check() == "ok"
    finally:
        keys.close()
        store.close()
