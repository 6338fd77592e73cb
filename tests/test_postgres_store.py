"""The Postgres trajectory store: the SQLite store's whole contract, plus several replicas at once.

The store's contract (``tests/_store_contract.py``), which ``test_sqlite_store.py`` runs on SQLite,
runs here again against a fresh Postgres database (this module's ``store`` fixture), so the two
databases cannot drift apart. The SQLite-only tests (a file reopened, WAL mode, a writer
killed while holding the file) have Postgres counterparts here: a reopened database keeps its data
and refuses a newer schema, and a server crash (immediate stop) loses no acknowledged write.
The replica tests run two store objects (two gateway processes' worth of pools) on one database
from threads: no lost turn, ``StaleWriteError`` exactly where SQLite raises it, shared visibility.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from slime_server.buffer.open import is_postgres_url, open_job_store, open_key_store, open_store
from slime_server.buffer.schema import (
    IdempotencyConflict,
    SessionClosedError,
    SessionForbidden,
    StaleWriteError,
    StoreError,
    StoreUnavailable,
    Trajectory,
    Turn,
)
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.buffer.store import ResponseRef, TurnWrite
from tests._postgres_helpers import PgCluster, admin_execute, create_database, drop_database, find_bindir
from tests._store_contract import StoreContract, _traj, _write

psycopg = pytest.importorskip("psycopg", reason="psycopg missing: install the 'postgres' extra")
from slime_server.buffer.postgres_store import PostgresTrajectoryStore  # noqa: E402

# ------------------------------------------------------------------ the server


class PgServer:
    """Where test databases are created; ``cluster`` is None for an external SLIME_TEST_POSTGRES_URL."""

    def __init__(self, admin_url: str, cluster: PgCluster | None) -> None:
        self.admin_url, self.cluster = admin_url, cluster
        self._names: list[str] = []

    def new_database(self) -> str:
        name, url = create_database(self.admin_url)
        self._names.append(name)
        return url

    def drop_all(self) -> None:
        for name in self._names:
            drop_database(self.admin_url, name)


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    external = os.environ.get("SLIME_TEST_POSTGRES_URL")
    if external:
        server = PgServer(external, None)
        yield server
        server.drop_all()
        return
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) found: apt-get install postgresql, "
                    "or set SLIME_TEST_POSTGRES_URL")
    cluster = PgCluster(bindir)
    try:
        yield PgServer(cluster.url(), cluster)
    finally:
        cluster.destroy()


@pytest.fixture
def db_url(pg: PgServer) -> str:
    return pg.new_database()


@pytest.fixture
def store(db_url: str) -> Iterator[PostgresTrajectoryStore]:
    """The contract's ``store``, on a fresh database of the test cluster."""
    s = PostgresTrajectoryStore(db_url)
    yield s
    s.close()


class TestPostgresStore(StoreContract):
    """The store's contract (``tests/_store_contract.py``), the same tests as on SQLite, on Postgres."""


# ------------------------------------------------------------------ Postgres counterparts of SQLite-only tests
def test_schema_is_versioned_and_reopen_keeps_data(db_url: str) -> None:
    s = PostgresTrajectoryStore(db_url)
    s.create_session("keep")
    s.close()
    s2 = PostgresTrajectoryStore(db_url)  # a second open (another replica starting) migrates nothing
    try:
        assert s2.schema_version() == PostgresTrajectoryStore.SCHEMA_VERSION == SQLiteTrajectoryStore.SCHEMA_VERSION
        assert s2.get_session("keep").id == "keep"
        assert s2.integrity_check() == "ok"
    finally:
        s2.close()
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0] == s2.SCHEMA_VERSION
        conn.execute("INSERT INTO schema_migrations VALUES (999, 0)")
    with pytest.raises(StoreError, match="newer"):
        PostgresTrajectoryStore(db_url)


def test_replicas_starting_together_migrate_once(db_url: str) -> None:
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: PostgresTrajectoryStore(db_url, pool_max=2), range(4)))
    try:
        assert {s.schema_version() for s in stores} == {PostgresTrajectoryStore.SCHEMA_VERSION}
    finally:
        for s in stores:
            s.close()


def test_acknowledged_write_survives_a_server_crash_and_the_store_recovers(pg: PgServer, db_url: str) -> None:
    if pg.cluster is None:
        pytest.skip("needs the test's own cluster (it crashes and restarts the server)")
    logprobs = [-(i + 1) / 7 for i in range(50)]
    store = PostgresTrajectoryStore(db_url)
    try:
        store.create_session("durable")
        traj = _write(store, _traj("durable", logprobs, response_id="chatcmpl-d"))
        pg.cluster.stop("immediate")  # like kill -9 of the server: no checkpoint, WAL replay on start
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as exc:
            store.get_session("durable")
        assert exc.value.status_code == 503
        with pytest.raises(StoreUnavailable):
            store.create_session("while-down")
        assert time.monotonic() - t0 < 5  # an immediate 503, not a request hanging on the pool
        pg.cluster.start()
        [back] = store.get_trajectories("durable")  # the very next call reconnects
        assert back.id == traj.id and back.rollout_logprobs[3:] == logprobs
        assert store.find_by_response_id("chatcmpl-d")[0][0].id == traj.id
        assert store.integrity_check() == "ok"
        store.create_session("after")
    finally:
        store.close()


def test_unreachable_server_is_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable, match="unavailable") as exc:
        PostgresTrajectoryStore("postgresql://nobody:s3cret@127.0.0.1:1/none")
    assert "s3cret" not in str(exc.value)


def test_a_stalled_lock_holder_gives_store_unavailable_not_a_hang(db_url: str) -> None:
    store = PostgresTrajectoryStore(db_url, busy_timeout_s=0.3)
    try:
        store.create_session("s")
        traj = _write(store, _traj("s", [-0.5]))
        with psycopg.connect(db_url) as stalled:  # another replica stuck inside a write to "s"
            stalled.execute("SELECT 1 FROM sessions WHERE id = 's' FOR UPDATE")
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                _write(store, traj.model_copy(update={"metadata": {"x": 1}}))
            assert time.monotonic() - t0 < 5
            store.create_session("other")  # other sessions are not blocked
        assert _write(store, traj.model_copy(update={"metadata": {"x": 1}})).revision == 2  # nothing half-written
    finally:
        store.close()


def test_statements_are_written_once_for_both_databases() -> None:
    """The stores write SQLite's parameters; the Postgres connection translates them, literal % included."""
    from slime_server.buffer.sql import to_pyformat

    assert to_pyformat("SELECT * FROM t WHERE a = ? AND b IN (?, ?)") == "SELECT * FROM t WHERE a = %s AND b IN (%s, %s)"
    assert to_pyformat("UPDATE t SET x = :x WHERE id = :id AND s LIKE 'a%'") == (
        "UPDATE t SET x = %(x)s WHERE id = %(id)s AND s LIKE 'a%%'")


def test_deadlocks_are_retried_whole_then_reported_busy(store: PostgresTrajectoryStore) -> None:
    calls: list[int] = []

    def flaky(conn: Any) -> str:
        calls.append(1)
        conn.execute("INSERT INTO sessions (id, metadata, status, created_at, updated_at) "
                     "VALUES (?, '{}', 'open', 0, 0)", (f"try-{len(calls)}",))
        if len(calls) < 3:
            raise psycopg.errors.DeadlockDetected("deadlock detected")
        return "done"

    assert store._db.write(flaky) == "done" and len(calls) == 3
    assert [s for s in ("try-1", "try-2", "try-3") if _exists(store, s)] == ["try-3"]  # aborted tries left nothing

    def always(conn: Any) -> None:
        raise psycopg.errors.SerializationFailure("could not serialize access")

    with pytest.raises(StoreUnavailable, match="busy"):
        store._db.write(always)


def _exists(store: PostgresTrajectoryStore, session_id: str) -> bool:
    try:
        store.get_session(session_id)
        return True
    except LookupError:
        return False


# ------------------------------------------------------------------ several replicas on one database
@pytest.fixture
def replicas(db_url: str) -> Iterator[tuple[PostgresTrajectoryStore, PostgresTrajectoryStore]]:
    a, b = PostgresTrajectoryStore(db_url), PostgresTrajectoryStore(db_url)
    yield a, b
    a.close()
    b.close()


def test_replicas_see_each_others_sessions_rewards_and_feedback(replicas) -> None:
    a, b = replicas
    a.create_session("s", group_id="g", metadata={"z": 1, "a": [1.5]})
    assert b.get_session("s").metadata == {"z": 1, "a": [1.5]}
    assert list(b.get_session("s").metadata) == ["z", "a"]  # text, not jsonb: key order kept
    weird = [-0.0, -1e-320, -math.inf, -5e-324]
    t = _write(a, _traj("s", weird, response_id="chatcmpl-x"))
    got = b.get_trajectory(t.id)
    assert [x.hex() for x in got.rollout_logprobs] == [x.hex() for x in t.rollout_logprobs]
    assert b.set_reward("s", reward=0.5, idempotency_key="k") is True
    assert a.get_trajectory(t.id).reward == 0.5
    assert a.set_reward("s", reward=0.5, idempotency_key="k") is False  # the key is shared, not per replica
    with pytest.raises(IdempotencyConflict):
        a.set_reward("s", reward=1.0, idempotency_key="k")
    a.add_feedback("chatcmpl-x", thumb="up")
    assert [f.thumb for f in b.get_feedback("chatcmpl-x")] == ["up"]
    assert b.stats().sessions == 1 and b.stats().feedback == 1
    [recent] = b.recent_sessions(10)  # the dashboard's session list, read on the other replica
    assert (recent.id, recent.num_trajectories, recent.num_tokens, recent.reward) == ("s", 1, 7, 0.5)
    b.close_session("s")
    with pytest.raises(SessionClosedError):
        _write(a, a.get_trajectory(t.id).model_copy(update={"metadata": {"late": True}}))
    assert a.get_trajectory(t.id).status == "finished"


def test_session_owner_is_enforced_across_replicas(replicas) -> None:
    a, b = replicas
    assert a.get_or_create_session("hdr", owner="key-1").owner == "key-1"
    with pytest.raises(SessionForbidden) as exc:
        b.get_or_create_session("hdr", owner="key-2")
    assert exc.value.status_code == 403
    assert b.get_or_create_session("hdr", owner="key-1").owner == "key-1"
    assert b.get_or_create_session("hdr").owner == "key-1"  # admin (no owner) reaches every session


def _race(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` in threads released together; each result is the return value or the exception."""
    gate = threading.Barrier(len(fns))

    def run(fn: Callable[[], Any]) -> Any:
        gate.wait()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the caller asserts on it
            return e

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(run, fns))


def test_concurrent_writes_to_one_trajectory_raise_stale_write_like_sqlite(replicas) -> None:
    a, b = replicas
    a.create_session("s")
    base = _write(a, _traj("s", [-0.5]))
    for _ in range(5):  # both replicas read the same revision, then both write: exactly one wins
        read = a.get_trajectory(base.id)
        out = _race([lambda s=s, r=read: _write(s, r.model_copy(update={"metadata": {"by": id(s)}}))
                     for s in (a, b)])
        assert sorted(type(x).__name__ for x in out) == ["StaleWriteError", "Trajectory"]
        winner = next(x for x in out if isinstance(x, Trajectory))
        assert a.get_trajectory(base.id).metadata == winner.metadata
        assert b.get_trajectory(base.id).revision == read.revision + 1
    # two replicas opening the same (segment, branch): one insert wins, the other is stale
    out = _race([lambda s=s, i=i: _write(s, _traj("s", [-0.25], response_id=f"chatcmpl-n{i}", segment=1))
                 for i, s in enumerate((a, b))])
    assert sorted(type(x).__name__ for x in out) == ["StaleWriteError", "Trajectory"]
    assert [t.segment for t in b.get_trajectories("s")] == [0, 1]


def _append_turn(store: PostgresTrajectoryStore, traj_id: str, tag: int) -> int:
    """Read-modify-write one more turn onto ``traj_id``, retrying on StaleWriteError; returns the retries."""
    retries = 0
    while True:
        t = store.get_trajectory(traj_id)
        n = len(t.tokens)
        rid = f"chatcmpl-w{tag}"
        new = t.model_copy(update={
            "tokens": [*t.tokens, 1000 + tag, tag], "loss_mask": [*t.loss_mask, 0, 1],
            "rollout_logprobs": [*t.rollout_logprobs, 0.0, -tag / 3], "weight_versions": [*t.weight_versions, -1, 7],
            "turns": [*t.turns, Turn(response_id=rid, prompt_start=n, output_start=n + 1, output_end=n + 2)],
            "turn_rewards": [*t.turn_rewards, None]})
        try:
            store.write_turn(TurnWrite(session_id=t.session_id, trajectories=[new],
                                       responses=[ResponseRef(response_id=rid, choice=0, trajectory_id=t.id)]))
            return retries
        except StaleWriteError:
            retries += 1


def test_many_writers_on_two_replicas_lose_no_turn(replicas) -> None:
    a, b = replicas
    a.create_session("busy")
    base = _write(a, _traj("busy", [-0.5]))
    writers, turns_each = 4, 6
    jobs = [(a if w % 2 else b, w * 100 + k) for w in range(writers) for k in range(turns_each)]
    with ThreadPoolExecutor(writers) as pool:
        retries = sum(pool.map(lambda job: _append_turn(job[0], base.id, job[1]), jobs))
    final = b.get_trajectory(base.id)
    tags = sorted(int(t.response_id.removeprefix("chatcmpl-w")) for t in final.turns[1:])
    assert tags == sorted(tag for _, tag in jobs)  # every turn landed exactly once
    assert final.revision == 1 + len(jobs)
    for turn in final.turns[1:]:  # and each turn's tokens are its own (no interleaved half-writes)
        tag = int(turn.response_id.removeprefix("chatcmpl-w"))
        assert final.tokens[turn.prompt_start:turn.output_end] == [1000 + tag, tag]
        assert final.rollout_logprobs[turn.output_start] == -tag / 3
    assert len(a.find_by_response_id(f"chatcmpl-w{jobs[-1][1]}")) == 1
    assert a.set_reward("busy", turn_rewards=[float(i) for i in range(1 + len(jobs))]) is True
    assert b.get_trajectory(base.id).turn_rewards == [float(i) for i in range(1 + len(jobs))]
    print(f"{len(jobs)} turns from {writers} writers on 2 replicas, {retries} stale-write retries")


def test_racing_creates_rewards_and_consumption_resolve_once(replicas) -> None:
    a, b = replicas
    out = _race([lambda s=s: s.get_or_create_session("hdr-race") for s in (a, b, a, b)])
    assert len({s.created_at for s in out}) == 1, out
    out = _race([lambda s=s: s.create_session("named") for s in (a, b)])
    assert sorted(type(x).__name__ for x in out) == ["Session", "SessionExistsError"]
    ids = [_write(a, _traj("hdr-race", [-0.5], response_id=f"chatcmpl-c{i}", segment=i)).id for i in range(6)]
    out = _race([lambda s=s: s.set_reward("hdr-race", reward=1.0, idempotency_key="once") for s in (a, b, a, b)])
    assert sorted(out) == [False, False, False, True]
    out = _race([lambda s=s, j=j: s.mark_consumed(ids, train_step=3, job_id=j) for s, j in ((a, "j1"), (b, "j2"))])
    assert sum(out) == len(ids)  # each trajectory consumed by exactly one trainer
    jobs_of = {t.id: t for t in b.list_trajectories(session_id="hdr-race")}
    assert all(t.consumed_step == 3 for t in jobs_of.values())


# ------------------------------------------------------------------ factory, jobs and keys
def test_open_store_picks_sqlite_for_paths(tmp_path: Path) -> None:
    s = open_store(tmp_path / "b.db")
    try:
        assert isinstance(s, SQLiteTrajectoryStore)
        assert not is_postgres_url(str(tmp_path / "b.db")) and is_postgres_url("postgres://h/db")
    finally:
        s.close()


def test_open_store_picks_postgres_for_urls_and_ports_jobs_and_keys(db_url: str) -> None:
    s = open_store(db_url)
    jobs = open_job_store(db_url)
    keys = open_key_store(db_url)
    try:
        assert isinstance(s, PostgresTrajectoryStore) and type(jobs).__name__ == "PostgresJobStore"
        row = jobs.insert_job("job-1", {"loss": "grpo"}, "queued", {"step": 0})
        jobs.update_job("job-1", status="running", state={"step": 2})
        jobs.add_metrics("job-1", 1, {"loss": 0.5})
        jobs.add_metrics("job-1", 1, {"loss": 0.25})  # a replayed step replaces, as INSERT OR REPLACE does
        e1, e2 = jobs.add_event("job-1", "started", {}), jobs.add_event("job-1", "step", {"n": 1})
        assert e2.seq > e1.seq and [e.kind for e in jobs.events("job-1", e1.seq)] == ["step"]
        got = jobs.get_job("job-1")
        assert (got.status, got.state, got.created_at) == ("running", {"step": 2}, row.created_at)
        assert [m.metrics for m in jobs.metrics("job-1")] == [{"loss": 0.25}]
        assert jobs.get_job("nope") is None and [j.id for j in jobs.list_jobs()] == ["job-1"]
        minted = keys.mint("agent", "bot")
        record, key_hash = keys.lookup(minted.id)
        assert record.role == "agent" and key_hash != minted.key and minted.key.split(".")[1] not in key_hash
        assert keys.revoke(minted.id).revoked_at is not None and keys.revoke("missing") is None
        assert [r.id for r in keys.list()] == [minted.id]
    finally:
        s.close()
        jobs.close()
        keys.close()


def test_adapter_aliases_on_postgres(db_url: str) -> None:
    from slime_server.buffer.open import open_adapter_store
    from tests._adapter_store_contract import check_adapter_store

    a, b = open_adapter_store(db_url), open_adapter_store(db_url)
    try:
        assert type(a).__name__ == "PostgresAdapterStore"
        check_adapter_store(a, b)
    finally:
        a.close()
        b.close()


def test_database_without_create_rights_fails_typed(pg: PgServer, db_url: str) -> None:
    if pg.cluster is None:
        pytest.skip("creates a role on the test's own cluster")
    admin_execute(pg.admin_url, "DO $$ BEGIN CREATE ROLE slime_ro LOGIN; EXCEPTION WHEN duplicate_object THEN END $$")
    admin_execute(db_url, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # a setup error, not a 503 to retry
        PostgresTrajectoryStore(db_url.replace("postgres@", "slime_ro@"))


def test_export_command_reads_a_postgres_store(store: PostgresTrajectoryStore, db_url: str, tmp_path: Path) -> None:
    from slime_server.buffer.export import read_jsonl
    from slime_server.cli import main

    store.create_session("done")
    t = _write(store, _traj("done", [-0.5, -0.125], response_id="chatcmpl-e"), close=True)
    store.set_reward("done", reward=1.0)
    out = tmp_path / "out.jsonl"
    assert main(["export", "--db-path", db_url, "-o", str(out)]) == 0
    [row] = read_jsonl(out)
    assert row.reward == 1.0 and row.tokens == t.tokens and row.session_id == "done"


def test_token_columns_hold_the_same_bytes_as_sqlite(store: PostgresTrajectoryStore, db_url: str,
                                                     tmp_path: Path) -> None:
    import sqlite3

    lite = SQLiteTrajectoryStore(tmp_path / "same.db")
    traj = _traj("s", [-0.1, -math.pi, -5e-324])
    try:
        for s in (store, lite):
            s.create_session("s")
            _write(s, traj)
    finally:
        lite.close()
    cols = "tokens, loss_mask, rollout_logprobs, weight_versions"
    with psycopg.connect(db_url) as conn:
        pg_row = conn.execute(f"SELECT {cols} FROM trajectories").fetchone()
    conn = sqlite3.connect(tmp_path / "same.db")
    try:
        lite_row = conn.execute(f"SELECT {cols} FROM trajectories").fetchone()
    finally:
        conn.close()
    assert tuple(map(bytes, pg_row)) == tuple(map(bytes, lite_row))
    assert store.integrity_check() == "ok"
    with psycopg.connect(db_url) as conn:  # a truncated array (a foreign or partial write) is reported
        conn.execute("UPDATE trajectories SET rollout_logprobs = substring(rollout_logprobs from 1 for 8)")
    assert "wrong length" in store.integrity_check()
