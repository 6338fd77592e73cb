"""The loop's training modes on a real SQLite buffer, with a recording stand-in for the Megatron ranks (outside
this unit; the real ranks run these modes in test_training_modes.py): rejection sampling, SFT on conversations,
train-only replay of an export, and the job specs that select them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from slime_server.buffer.export import export_jsonl
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.buffer.store import DROPPED_STEP
from slime_server.jobs.spec import JobSpec
from slime_server.trainer.loop import EngineControl, TrainLoop
from slime_server.trainer.selection import Rejection
from slime_server.trainer.settings import LoopSettings
from slime_server.trainer.sources import ConversationSource, ReplaySource, SourceError, read_conversations
from slime_server.trainer.types import TrainSample
from tests._loop_helpers import RecordingTrainer, add


@pytest.fixture
def store(tmp_path: Path):
    s = SQLiteTrajectoryStore(tmp_path / "buffer.db")
    yield s
    s.close()


def make_loop(store, tmp_path: Path, **kw: Any) -> tuple[TrainLoop, RecordingTrainer, list[tuple[str, dict]]]:
    trainer = RecordingTrainer()
    events: list[tuple[str, dict[str, Any]]] = []
    settings = kw.pop("settings", {})
    lp = TrainLoop(store, lambda: trainer, EngineControl(lambda: []), LoopSettings(**settings), tmp_path,
                   job_id=kw.pop("job_id", "job-x"), on_event=lambda k, d: events.append((k, d)), **kw)
    lp.trainer = trainer
    return lp, trainer, events


def test_rejection_sampling_trains_only_what_passes(store, tmp_path: Path) -> None:
    lp, trainer, events = make_loop(store, tmp_path, supervised=True, rejection=Rejection(threshold=1.0),
                                    settings={"batch_size": 6, "n_samples_per_prompt": 3})
    a = [add(store, f"a{i}", group="A", reward=r) for i, r in enumerate((1.0, 0.0, 1.0))]
    b = [add(store, f"b{i}", group="B", reward=r) for i, r in enumerate((0.0, 0.5, 0.0))]
    metrics = lp.step_once()
    assert metrics is not None
    trained = trainer.batches[0]
    assert [s.sample_id for s in trained] == [a[0], a[2]]  # every kept sample passes the threshold
    assert all(s.reward >= 1.0 for s in trained)
    assert all(s.advantages is None for s in trained)  # SFT: the NLL of the masked tokens, no advantages
    assert trainer.scored == []  # nor old log-probs
    assert [store.get_trajectory(t).consumed_step for t in a] == [1, DROPPED_STEP, 1]
    assert [store.get_trajectory(t).consumed_step for t in b] == [DROPPED_STEP] * 3  # stored, never trained
    assert (lp.state.kept, lp.state.rejected) == (2, 4) and (metrics["kept"], metrics["rejected"]) == (2, 4)
    assert ("rejection", {"kept": 2, "rejected": 4, "total_kept": 2, "total_rejected": 4}) in events

    # a batch where nothing passes is no step: all of it rejected, the step count unchanged
    [add(store, f"c{i}", group="C", reward=0.0) for i in range(6)]
    lp.settings = lp.settings.model_copy(update={"n_samples_per_prompt": 6})
    assert lp.step_once() is None and lp.state.step == 1 and lp.state.rejected == 10


def test_kept_samples_count_once_they_have_trained(store, tmp_path: Path) -> None:
    """A step that fails (a rank died mid-step) is redone with the same batch: its groups are still whole (the
    rejected samples are dropped only once the step has trained) and its kept samples count once."""
    lp, trainer, events = make_loop(store, tmp_path, supervised=True, rejection=Rejection(threshold=1.0),
                                    settings={"batch_size": 3, "n_samples_per_prompt": 3})
    a = [add(store, f"a{i}", group="A", reward=r) for i, r in enumerate((1.0, 0.0, 1.0))]
    calls = {"n": 0}
    train = trainer.train_step

    def failing_once(samples, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("rank died")
        return train(samples, **kw)

    trainer.train_step = failing_once
    with pytest.raises(RuntimeError):
        lp.step_once()
    assert (lp.state.kept, lp.state.rejected, lp.state.step) == (0, 0, 0)
    assert [store.get_trajectory(t).consumed_step for t in a] == [None, None, None]
    metrics = lp.step_once()  # the same two samples, trained now
    assert metrics is not None and [s.sample_id for s in trainer.batches[0]] == [a[0], a[2]]
    assert (lp.state.kept, lp.state.rejected) == (2, 1) and (metrics["kept"], metrics["rejected"]) == (2, 1)
    assert [d for k, d in events if k == "rejection"] == [{"kept": 2, "rejected": 1, "total_kept": 2,
                                                            "total_rejected": 1}]
    assert [store.get_trajectory(t).consumed_step for t in a] == [1, DROPPED_STEP, 1]


def test_best_of_n_keeps_each_groups_best_if_it_passes() -> None:
    from slime_server.buffer.schema import Trajectory as T

    def t(i: str, group: str, reward: float) -> T:
        return T(id=i, session_id=i, group_id=group, reward=reward)

    chosen = [t("a0", "A", 0.2), t("a1", "A", 0.9), t("a2", "A", 0.9), t("b0", "B", 0.1), t("b1", "B", 0.3)]
    assert Rejection(threshold=0.5, keep="best_of_n").keep_ids(chosen) == ["a1"]  # B's best fails; first on a tie
    assert Rejection(threshold=None, keep="best_of_n").keep_ids(chosen) == ["a1", "b1"]
    assert Rejection(threshold=0.3).keep_ids(chosen) == ["a1", "a2", "b1"]


def _sample(n: int) -> TrainSample:
    return TrainSample(tokens=list(range(1, n + 2)), loss_mask=[0] + [1] * n, rollout_logprobs=[0.0] * (n + 1),
                       weight_versions=[-1] * (n + 1), sample_id=f"s{n}")


def test_conversation_source_is_a_function_of_the_step_and_ends_the_job(store, tmp_path: Path) -> None:
    samples = [_sample(n) for n in range(1, 6)]
    src = ConversationSource(samples, batch_size=2, epochs=2, seed=3)
    assert src.steps == 5  # 10 sample visits in batches of 2
    ids = [[s.sample_id for s in src.batch(k, 0).samples] for k in range(5)]
    assert sorted(i for b in ids for i in b) == sorted([s.sample_id for s in samples] * 2)  # each once per epoch
    assert ids == [[s.sample_id for s in ConversationSource(samples, batch_size=2, epochs=2, seed=3).batch(k, 0).samples]
                   for k in range(5)]  # same file and seed, same batches
    assert ids != [[s.sample_id for s in ConversationSource(samples, batch_size=2, epochs=2, seed=4).batch(k, 0).samples]
                   for k in range(5)]
    assert src.batch(5, 0) is None

    lp, trainer, _ = make_loop(store, tmp_path, source=src, supervised=True, settings={"batch_size": 2})
    lp.run()  # returns when the source is exhausted (the job completes), no max_steps needed
    assert lp.state.step == 5 and lp.exhausted
    assert [[s.sample_id for s in b] for b in trainer.batches] == ids
    assert trainer.pushes == [1, 2, 3, 4, 5]  # the engines get every step's weights, as for RL
    # a restored job goes on with the batch after its checkpoint
    lp2, trainer2, _ = make_loop(store, tmp_path, source=src, supervised=True, settings={"batch_size": 2})
    lp2.state.step = 3
    lp2.run()
    assert [[s.sample_id for s in b] for b in trainer2.batches] == ids[3:]


def test_conversations_file_openai_messages_and_slime_keys(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                             "tools": tools}) + "\n\n"
                 + json.dumps({"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]})
                 + "\n")
    rows = read_conversations(f)
    assert rows[0]["tools"] == tools and rows[1]["tools"] is None and len(rows) == 2
    g = tmp_path / "slime.jsonl"
    g.write_text(json.dumps({"question": "What is 2+2?", "answer": 4}) + "\n")
    rows = read_conversations(g, input_key="question", label_key="answer", system_prompt="Be brief.")
    assert rows[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(SourceError, match="no 'answer' field"):
        read_conversations(f, label_key="answer")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(SourceError, match="bad.jsonl:1: no assistant message"):
        read_conversations(bad)


def test_replay_reproduces_the_jobs_own_batches_from_an_export(store, tmp_path: Path) -> None:
    lp, trainer, _ = make_loop(store, tmp_path, job_id="job-orig",
                               settings={"batch_size": 4, "n_samples_per_prompt": 2, "advantage": {"estimator": "grpo"}})
    for g in "ABCDEF":  # three batches of two groups; the middle of the pool is another job's
        [add(store, f"{g}{i}", group=g, reward=float(i)) for i in range(2)]
    add(store, "lone", group="Z")  # an incomplete group: never trained, still exported
    for _ in range(2):
        assert lp.step_once() is not None
    other, _, _ = make_loop(store, tmp_path, job_id="job-other",
                            settings={"batch_size": 4, "n_samples_per_prompt": 2, "advantage": {"estimator": "grpo"}})
    assert other.step_once() is not None
    export = tmp_path / "export.jsonl"
    assert export_jsonl(store, export) == 13

    src = ReplaySource(export, batch_size=4, group_size=2, job_id="job-orig")
    assert src.recorded and len(src.batches) == 2
    replay, replayed, _ = make_loop(store, tmp_path, source=src, job_id="job-replay",
                                    settings={"batch_size": 4, "n_samples_per_prompt": 2, "advantage": {"estimator": "grpo"}})
    replay.run()
    assert replay.state.step == 2
    for orig, again in zip(trainer.batches, replayed.batches, strict=True):
        assert [s.sample_id for s in again] == [s.sample_id for s in orig]
        for a, b in zip(orig, again, strict=True):  # token-exact, with the same advantages
            assert (a.tokens, a.loss_mask, a.rollout_logprobs, a.weight_versions, a.reward, a.group_id, a.advantages) \
                == (b.tokens, b.loss_mask, b.rollout_logprobs, b.weight_versions, b.reward, b.group_id, b.advantages)
    stored = store.list_trajectories(limit=100)
    assert {t.consumed_job for t in stored} == {"job-orig", "job-other", None}  # the replay consumed nothing

    # without a job: whole groups in file order (the incomplete one left out)
    everything = ReplaySource(export, batch_size=4, group_size=2)
    assert not everything.recorded and len(everything.batches) == 3
    assert [s.group_id for b in everything.batches for s in b] == [g for g in "ABCDEF" for _ in range(2)]
    with pytest.raises(SourceError, match="no sample was trained by job 'job-nope'"):
        ReplaySource(export, batch_size=4, group_size=2, job_id="job-nope")


def test_specs_of_the_modes(tmp_path: Path) -> None:
    conv = tmp_path / "c.jsonl"
    conv.write_text("{}\n")
    JobSpec.model_validate({"algorithm": "sft", "data": {"source": "conversations", "dataset": str(conv)}})
    JobSpec.model_validate({"algorithm": "sft", "rejection": {"threshold": 1.0},
                            "data": {"source": "dataset", "environment": "calculator"}})
    JobSpec.model_validate({"train": False, "data": {"source": "dataset", "environment": "calculator"},
                            "pacing": {"max_buffered": 1}})  # nothing is consumed: pacing is not asked about
    JobSpec.model_validate({"data": {"source": "replay", "dataset": str(conv), "replay_job": "job-1"}})
    for body, message in [
        ({"data": {"source": "conversations", "dataset": str(conv)}}, "set algorithm 'sft'"),
        ({"algorithm": "sft", "data": {"source": "conversations"}}, "needs data.dataset"),
        ({"algorithm": "sft", "data": {"source": "dataset", "environment": "calculator"}}, "set rejection"),
        ({"algorithm": "grpo", "rejection": {}, "loop": {"n_samples_per_prompt": 2, "batch_size": 2},
          "data": {"source": "dataset", "environment": "calculator"}}, "rejection sampling trains SFT"),
        ({"train": False}, "rollout-only"),
        ({"data": {"replay_job": "job-1"}}, "data.replay_job is for"),
        ({"algorithm": "sft", "data": {"source": "conversations", "dataset": str(conv)},
          "loop": {"advantage": {"kl_coef": 0.1}}}, "no advantages to shape"),
    ]:
        with pytest.raises(ValidationError, match=message):
            JobSpec.model_validate(body)
    sft = JobSpec.model_validate({"algorithm": "sft", "data": {"source": "conversations", "dataset": str(conv)}})
    assert sft.loss_config() == {"loss_type": "sft", "use_tis": False}
