"""Export of finished trajectories as slime samples (JSONL; Parquet when pyarrow is installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _sessions_helpers import FakeEngine, client_message

from slime_server.api.chat_template import ChatRenderer
from slime_server.buffer.export import export_jsonl, export_parquet, read_jsonl
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.sessions import SessionManager


@pytest.fixture
def filled(tmp_path: Path, tiny_model_path: Path):
    """Two sessions recorded through the real session layer: a 2-turn one (closed, rewarded) and an open one."""
    store = SQLiteTrajectoryStore(tmp_path / "b.db")
    engine = FakeEngine(ChatRenderer(tiny_model_path))
    sm = SessionManager(store, engine.renderer)
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    c1 = engine.choice(engine.response_id(), 0, "", tool_calls=[("add", '{"a": 2, "b": 3}')], version=1)
    sm.commit_turn(sm.prepare_turn("done", msgs, None), [c1])
    msgs += [client_message(c1), {"role": "tool", "tool_call_id": "x", "content": "5"}]
    c2 = engine.choice(engine.response_id(), 0, "It is 5.", version=2)
    sm.commit_turn(sm.prepare_turn("done", msgs, None), [c2])
    store.set_reward("done", reward=1.0, idempotency_key="r1")
    store.close_session("done")
    sm.commit_turn(sm.prepare_turn("live", [{"role": "user", "content": "hi"}], None),
                   [engine.choice(engine.response_id(), 0, "Hello.")])
    yield store, engine
    store.close()


def test_jsonl_has_slime_sample_fields(filled, tmp_path: Path) -> None:
    store, engine = filled
    out = tmp_path / "finished.jsonl"
    assert export_jsonl(store, out) == 1  # only the finished trajectory
    [raw] = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"tokens", "response_length", "loss_mask", "rollout_log_probs", "reward", "metadata",
            "group_index"} <= raw.keys()
    [sample] = read_jsonl(out)
    [traj] = store.get_trajectories("done")
    first, second = traj.turns
    assert sample.tokens == traj.tokens and sample.reward == 1.0 and sample.group_index == "done"
    assert sample.response_length == len(traj.tokens) - first.output_start
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    # Inside the response span, the tool result and the template glue are masked out.
    rel = second.prompt_start - first.output_start
    assert sample.loss_mask[:rel] == [1] * rel
    assert sample.loss_mask[rel: second.output_start - first.output_start] == [0] * (second.output_start
                                                                                     - second.prompt_start)
    gen = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if m]
    expected = engine.ledger[(first.response_id, 0)][1] + engine.ledger[(second.response_id, 0)][1]
    assert [x.hex() for x in gen] == [x.hex() for x in expected]  # bit-exact through JSON
    assert sample.status == "completed" and sample.metadata["prompt_length"] == first.output_start
    assert export_jsonl(store, tmp_path / "all.jsonl", status=None) == 2
    assert export_jsonl(store, tmp_path / "none.jsonl", status="finished", rewarded=False) == 0


def test_parquet_when_available(filled, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    store, _ = filled
    assert export_parquet(store, tmp_path / "f.parquet") == 1
    table = pq.read_table(tmp_path / "f.parquet").to_pylist()
    assert table[0]["tokens"] == store.get_trajectories("done")[0].tokens


def test_export_command_writes_jsonl_and_refuses_a_missing_store(filled, tmp_path: Path) -> None:
    from slime_server.cli import main

    out = tmp_path / "out.jsonl"
    assert main(["export", "--db-path", str(tmp_path / "b.db"), "--output", str(out)]) == 0
    rows = read_jsonl(out)
    assert [r.metadata["session_id"] for r in rows] == ["done"] and rows[0].reward == 1.0
    assert main(["export", "--db-path", str(tmp_path / "b.db"), "--status", "all", "-o", str(out)]) == 0
    assert len(read_jsonl(out)) == 2
    missing = tmp_path / "nope.db"
    assert main(["export", "--db-path", str(missing), "-o", str(out)]) == 2
    assert not missing.exists()
