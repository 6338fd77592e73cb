"""Export of finished trajectories as slime samples (JSONL; Parquet when pyarrow is installed), read back by
a reader that follows slime's own ``Sample``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_server.buffer.export import export_jsonl, export_parquet, read_jsonl
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.gateway.chat_template import ChatRenderer
from slime_server.gateway.sessions import SessionManager
from tests._sessions_helpers import FakeEngine, client_message


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
    assert sample.tokens == traj.tokens and sample.reward == 1.0 and sample.group_index == 0
    assert sample.metadata["group_id"] == "done" and sample.metadata["trajectory_id"] == traj.id
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
    assert [r.session_id for r in rows] == ["done"] and rows[0].reward == 1.0
    assert main(["export", "--db-path", str(tmp_path / "b.db"), "--status", "all", "-o", str(out)]) == 0
    assert len(read_jsonl(out)) == 2
    missing = tmp_path / "nope.db"
    assert main(["export", "--db-path", str(missing), "-o", str(out)]) == 2
    assert not missing.exists()


# slime's Sample (slime/utils/types.py at THUDM/slime 624b824, read there, not from our exporter): each
# field's allowed JSON types as its annotation and default admit them (tensor-valued fields are absent from
# a JSON export; ``status`` is ``Status(value)``; ``from_dict`` also takes ``spec_info`` and
# ``prefix_cache_info`` and sets any other key as an attribute).
SLIME_SAMPLE_FIELDS: dict[str, tuple[type, ...]] = {
    "group_index": (int, type(None)), "index": (int, type(None)), "rollout_id": (int, type(None)),
    "prompt": (str, list), "tokens": (list,), "multimodal_inputs": (dict, type(None)),
    "multimodal_train_inputs": (dict, type(None)), "multimodal_train_input_id": (str, type(None)),
    "apply_chat_template_kwargs": (dict,), "response": (str,), "response_length": (int,),
    "label": (str, type(None)), "reward": (float, int, dict, type(None)), "loss_mask": (list, type(None)),
    "weight_versions": (list,), "rollout_log_probs": (list, type(None)), "remove_sample": (bool,),
    "teacher_log_probs": (list, type(None)), "status": (str,), "metadata": (dict,),
    "generate_function_path": (str, type(None)), "custom_rm_path": (str, type(None)),
    "train_metadata": (dict, type(None)), "session_id": (str, type(None)),
    # added since (THUDM/slime 0d234f3): the engine's routed experts, a numpy array [positions, layers, topk] in a
    # live Sample, nested lists in JSON
    "rollout_routed_experts": (list, type(None)),
}
SLIME_STATUS = {"pending", "completed", "truncated", "aborted", "failed"}
SLIME_LIST_ITEMS = {"tokens": int, "loss_mask": int, "weight_versions": str, "rollout_log_probs": float}


def slime_sample(raw: dict) -> dict:
    """What ``Sample.from_dict`` would build from ``raw``, checked field by field against slime's types."""
    unknown = set(raw) - set(SLIME_SAMPLE_FIELDS)
    assert not unknown, f"not fields of slime's Sample (from_dict would set them as attributes): {unknown}"
    for name, value in raw.items():
        assert isinstance(value, SLIME_SAMPLE_FIELDS[name]) and not (isinstance(value, bool) and name != "remove_sample"), \
            (name, value)
        if name in SLIME_LIST_ITEMS and value is not None:
            assert all(type(x) is SLIME_LIST_ITEMS[name] for x in value), (name, value[:5])
    assert raw["status"] in SLIME_STATUS
    assert raw["response_length"] <= len(raw["tokens"])
    for name in ("loss_mask", "rollout_log_probs"):  # slime: they cover the response only
        assert raw.get(name) is None or len(raw[name]) == raw["response_length"], name
    return raw


def test_the_export_reads_as_slime_samples(filled, tmp_path: Path) -> None:
    store, engine = filled
    out = tmp_path / "all.jsonl"
    assert export_jsonl(store, out, status=None) == 2
    done, live = [slime_sample(json.loads(line)) for line in out.read_text().splitlines()]
    assert (done["index"], live["index"]) == (0, 1) and (done["rollout_id"], live["rollout_id"]) == (0, 1)
    assert done["session_id"] == "done" and done["status"] == "completed"
    # one version per generation, as slime appends SGLang's meta_info["weight_version"]: the turns ran on 1, 2
    assert done["weight_versions"] == ["1", "2"] and live["weight_versions"] == ["0"]
    [traj] = store.get_trajectories("done")
    start = len(traj.tokens) - done["response_length"]
    assert done["metadata"]["token_weight_versions"] == traj.weight_versions[start:]  # nothing lost
