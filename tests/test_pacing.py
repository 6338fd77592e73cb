"""Buffer pacing's decision (``gateway/pacing.py``) on a real SQLite store: the count of finished, rewarded,
untrained trajectories against the running job's ``max_buffered``, read at most every ``COUNT_TTL_S``, and
answered from the last count without touching the store while that count is fresh."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.buffer.store import ResponseRef, TurnWrite
from slime_server.buffer.trajectory_store import READY_COUNT_SQL
from slime_server.gateway.pacing import COUNT_TTL_S, Pacer
from slime_server.jobs.spec import PacingSpec
from tests._store_contract import _traj


class Manager:
    """The job manager's one answer the pacer asks for (outside the unit: which job runs)."""

    def __init__(self, pacing: PacingSpec | None) -> None:
        self.pacing = pacing

    def active_pacing(self) -> PacingSpec | None:
        return self.pacing


class CountingStore(SQLiteTrajectoryStore):
    """The real store, counting how often the pacer reads it."""

    reads = 0

    def count_ready(self) -> int:
        self.reads += 1
        return super().count_ready()


def finish(store: SQLiteTrajectoryStore, name: str) -> str:
    store.create_session(name)
    t = _traj(name, [-0.5], response_id=f"chatcmpl-{name}")
    store.write_turn(TurnWrite(session_id=name, trajectories=[t],
                               responses=[ResponseRef(response_id=f"chatcmpl-{name}", choice=0, trajectory_id=t.id)]))
    store.set_reward(name, reward=1.0, finish=True)
    return t.id


def test_pacing_counts_the_buffer_and_answers_from_a_fresh_count(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "s.db")
    now = [100.0]
    manager = Manager(PacingSpec(max_buffered=2, retry_after_s=3.0))
    pacer = Pacer(store, lambda: manager, clock=lambda: now[0])
    assert pacer.cached() == (False, None)  # never read: the caller must read (off the event loop)
    first = finish(store, "a")
    assert pacer.retry_after() is None and store.reads == 1  # 1 of 2 buffered: admitted
    finish(store, "b")
    store.create_session("open")  # an open, unrewarded session is not buffered
    assert pacer.cached() == (True, None) and store.reads == 1  # the fresh count still says 1
    now[0] += COUNT_TTL_S + 0.01
    assert pacer.cached() == (False, None)
    assert pacer.retry_after() == 3.0 and store.reads == 2  # 2 of 2: wait 3 s
    assert pacer.cached() == (True, 3.0) and store.reads == 2
    store.mark_consumed([first], 1)  # the trainer took one
    now[0] += COUNT_TTL_S + 0.01
    assert pacer.retry_after() is None and store.reads == 3
    manager.pacing = None  # no job trains: nothing is paced, nothing is read
    now[0] += COUNT_TTL_S + 0.01
    assert pacer.cached() == (True, None) and pacer.retry_after() is None and store.reads == 3


def test_the_ready_count_reads_the_pick_index_not_the_whole_store(tmp_path: Path) -> None:
    """What pacing counts must not cost a scan of every trajectory ever stored (the store outgrows the buffer):
    SQLite's plan for it searches the pick index (status, consumed_step) and visits only the rows it names."""
    store = SQLiteTrajectoryStore(tmp_path / "s.db")
    finish(store, "a")
    assert store.count_ready() == store.stats().unconsumed_finished_rewarded == 1
    conn = sqlite3.connect(tmp_path / "s.db")
    plan = " ".join(r[-1] for r in conn.execute(f"EXPLAIN QUERY PLAN {READY_COUNT_SQL}"))
    assert "SEARCH trajectories USING INDEX trajectories_pick (status=? AND consumed_step=?)" in plan, plan
