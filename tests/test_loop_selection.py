"""Batch selection of trainer/loop.py on a real SQLite buffer: whole groups only, staleness policies,
zero-variance dropping, and what a step does to the buffer (with a recording stand-in for the ranks,
which are outside this unit; the real ranks run in test_jobs_e2e.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from slime_server.buffer.schema import Trajectory
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.buffer.store import TurnWrite
from slime_server.trainer.loop import EngineControl, TrainLoop
from slime_server.trainer.selection import TrainingStalled
from slime_server.trainer.settings import LoopSettings
from tests._loop_helpers import RecordingTrainer, add


@pytest.fixture
def store(tmp_path: Path):
    s = SQLiteTrajectoryStore(tmp_path / "buffer.db")
    yield s
    s.close()


def loop(store, tmp_path: Path, **settings: Any) -> tuple[TrainLoop, RecordingTrainer]:
    trainer = RecordingTrainer()
    lp = TrainLoop(store, lambda: trainer, EngineControl(lambda: []), LoopSettings(**settings), tmp_path,
                   job_id="job-x")
    lp.trainer = trainer
    return lp, trainer


def test_groups_train_only_when_complete_and_whole(store, tmp_path: Path) -> None:
    lp, trainer = loop(store, tmp_path, batch_size=4, n_samples_per_prompt=2, advantage={"estimator": "grpo"})
    a = [add(store, f"a{i}", group="A", reward=float(i)) for i in range(2)]
    add(store, "b0", group="B")  # B is missing its second sample
    assert lp.step_once() is None  # 2 complete samples < batch of 4
    c = [add(store, f"c{i}", group="C", reward=float(i)) for i in range(2)]
    metrics = lp.step_once()
    assert metrics is not None and metrics["samples"] == 4
    assert [s.sample_id for s in trainer.batches[0]] == a + c
    advs = [s.advantages[-1] for s in trainer.batches[0]]
    assert advs[0] < 0 < advs[1] and advs[2] < 0 < advs[3]  # GRPO within each group
    assert [store.get_trajectory(t).consumed_step for t in a + c] == [1] * 4
    assert trainer.pushes == [1] and lp.state.version == 1


def test_a_waiting_job_says_why_and_incomplete_groups_expire(store, tmp_path: Path) -> None:
    clock = [time.time()]
    events: list[tuple[str, dict[str, Any]]] = []
    trainer = RecordingTrainer()
    lp = TrainLoop(store, lambda: trainer, EngineControl(lambda: []),
                   LoopSettings(batch_size=2, n_samples_per_prompt=2, group_timeout_s=60, advantage={"estimator": "grpo"}),
                   tmp_path, job_id="job-x", on_event=lambda k, d: events.append((k, d)), clock=lambda: clock[0])
    lp.trainer = trainer
    lone = [add(store, "x0", group="X"), add(store, "y0", group="Y")]  # each group is missing a member
    store.create_session("open-rewarded")  # an episode rewarded but never finished
    store.write_turn(TurnWrite(session_id="open-rewarded", trajectories=[Trajectory(
        session_id="open-rewarded", tokens=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -0.5],
        weight_versions=[-1, 0])]))
    store.set_reward("open-rewarded", reward=1.0)
    assert lp.step_once() is None
    assert lp.state.waiting == ("waiting for complete groups of 2: 0 of 2 samples ready; 2 sessions in "
                                "incomplete groups; 1 rewarded session still open")
    assert [k for k, _ in events] == ["waiting"] and events[0][1]["incomplete_sessions"] == 2
    clock[0] += 59  # not yet
    lp._waiting_at = float("-inf")
    assert lp.step_once() is None and lp.state.dropped_incomplete == 0
    assert [k for k, _ in events] == ["waiting"]  # the same reason is not repeated
    clock[0] += 2  # past the timeout: both lone members are dropped, never trained, still stored
    assert lp.step_once() is None
    assert lp.state.dropped_incomplete == 2
    assert [store.get_trajectory(t).consumed_step for t in lone] == [-1, -1]
    dropped = next(d for k, d in events if k == "dropped")
    assert dropped["incomplete_groups"] == 2 and dropped["stale"] == 0
    a = [add(store, f"a{i}", group="A", reward=float(i)) for i in range(2)]
    assert lp.step_once() is not None and lp.state.waiting is None
    assert [s.sample_id for s in trainer.batches[0]] == a


def test_a_batch_must_hold_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiple of n_samples_per_prompt"):
        LoopSettings(batch_size=6, n_samples_per_prompt=4)


def test_stale_samples_dropped_downweighted_or_kept(store, tmp_path: Path) -> None:
    for policy, expect_trained, expect_dropped in (("drop", 2, 2), ("downweight", 4, 0), ("keep", 4, 0)):
        lp, trainer = loop(store, tmp_path, batch_size=2, max_staleness=1, stale_policy=policy,
                           advantage={"estimator": "reinforce_plus_plus"})
        lp.state.version = 5
        ids = [add(store, f"{policy}-old{i}", version=3, reward=float(i)) for i in range(2)]
        ids += [add(store, f"{policy}-new{i}", version=5, reward=float(i)) for i in range(2)]
        while lp.step_once() is not None:
            pass
        trained = sum(len(b) for b in trainer.batches)
        assert (trained, lp.state.dropped_stale) == (expect_trained, expect_dropped), policy
        if policy == "drop":
            assert store.get_trajectory(ids[0]).consumed_step == -1
        if policy == "downweight":
            assert lp.state.downweighted == 2
            first = trainer.batches[0]  # the old pair: lag 2 -> advantages x 0.5
            assert abs(first[1].advantages[-1]) == pytest.approx(0.5 * abs(trainer.batches[1][1].advantages[-1]))


def test_zero_variance_groups_are_dropped_when_asked(store, tmp_path: Path) -> None:
    lp, trainer = loop(store, tmp_path, batch_size=2, n_samples_per_prompt=2, drop_zero_variance_groups=True,
                       advantage={"estimator": "grpo"})
    flat = [add(store, f"f{i}", group="F", reward=1.0) for i in range(2)]
    add(store, "g0", group="G", reward=0.0)
    add(store, "g1", group="G", reward=1.0)
    assert lp.step_once() is not None
    assert lp.state.dropped_zero_variance == 2
    assert [store.get_trajectory(t).consumed_step for t in flat] == [-1, -1]
    assert len(trainer.batches) == 1 and {s.group_id for s in trainer.batches[0]} == {"G"}


def test_a_job_that_can_never_train_again_fails_saying_why(store, tmp_path: Path) -> None:
    # a collapsed policy: every group all reward 0; the streak counts groups since the last step, across polls
    lp, trainer = loop(store, tmp_path, batch_size=4, n_samples_per_prompt=2, drop_zero_variance_groups=True,
                       max_flat_groups_in_a_row=3, advantage={"estimator": "grpo"})
    for g in "AB":
        add(store, f"{g}0", group=g, reward=0.0)
        add(store, f"{g}1", group=g, reward=0.0)
    assert lp.step_once() is None and lp.state.flat_groups_in_a_row == 2
    add(store, "C0", group="C", reward=0.0)
    add(store, "C1", group="C", reward=1.0)  # a group with signal; the batch is not whole yet: no reset
    assert lp.step_once() is None and lp.state.flat_groups_in_a_row == 2
    add(store, "D0", group="D", reward=1.0)
    add(store, "D1", group="D", reward=0.0)
    assert lp.step_once() is not None and lp.state.flat_groups_in_a_row == 0  # a step resets it
    for g in "EFG":
        add(store, f"{g}0", group=g, reward=0.0)
        add(store, f"{g}1", group=g, reward=0.0)
    with pytest.raises(TrainingStalled, match=r"no step for 3 groups in a row.*latest: 0\b"):
        lp.step_once()
    assert len(trainer.batches) == 1 and lp.state.dropped_zero_variance == 10  # all stored, none trained


def test_flat_groups_wait_for_ever_when_the_limit_is_off(store, tmp_path: Path) -> None:
    lp, trainer = loop(store, tmp_path, batch_size=2, n_samples_per_prompt=2, drop_zero_variance_groups=True,
                       max_flat_groups_in_a_row=None, advantage={"estimator": "grpo"})
    for g in "ABCDE":
        add(store, f"{g}0", group=g, reward=1.0)
        add(store, f"{g}1", group=g, reward=1.0)
    assert lp.step_once() is None and lp.state.flat_groups_in_a_row == 5 and not trainer.batches


def test_unrewarded_and_open_trajectories_are_not_taken(store, tmp_path: Path) -> None:
    lp, trainer = loop(store, tmp_path, batch_size=1)
    add(store, "u", reward=None)
    assert lp.step_once() is None and trainer.batches == []


def test_several_optimizer_steps_per_batch_share_one_old_policy(store, tmp_path: Path) -> None:
    """num_steps_per_rollout: the batch in consecutive mini-batches, each trained against the log-probs scored
    once before the first step; one version and one push for the whole batch."""
    lp, trainer = loop(store, tmp_path, batch_size=4, n_samples_per_prompt=2, num_steps_per_rollout=2,
                       advantage={"estimator": "grpo"})
    ids = [add(store, f"a{i}", group="A", reward=float(i)) for i in range(2)]
    ids += [add(store, f"b{i}", group="B", reward=float(i)) for i in range(2)]
    metrics = lp.step_once()
    assert trainer.scored == [(4, False)]
    assert [[s.sample_id for s in b] for b in trainer.batches] == [ids[:2], ids[2:]]
    for kw in trainer.kwargs:
        assert [o.tolist() for o in kw["old_logprobs"]] == [[-0.5] * 6] * 2 and kw["bump_version"] is False
    assert metrics["optimizer_steps"] == 2.0 and metrics["loss"] == 0.75 and metrics["ratio_max"] == 2.0
    assert lp.state.step == 1 and lp.state.version == 1 and trainer.pushes == [1]


def test_one_step_per_batch_scores_nothing_beforehand(store, tmp_path: Path) -> None:
    lp, trainer = loop(store, tmp_path, batch_size=2, n_samples_per_prompt=2, advantage={"estimator": "grpo"})
    [add(store, f"a{i}", group="A", reward=float(i)) for i in range(2)]
    lp.step_once()
    assert trainer.scored == [] and trainer.kwargs[0]["old_logprobs"] is None


def test_kl_reward_shaping_scores_policy_and_reference(store, tmp_path: Path) -> None:
    lp, trainer = loop(store, tmp_path, batch_size=2, n_samples_per_prompt=2,
                       advantage={"estimator": "reinforce_plus_plus", "kl_coef": 0.5, "gamma": 1.0})
    [add(store, f"a{i}", group="A", reward=1.0) for i in range(2)]
    lp.step_once()
    assert trainer.scored == [(2, False), (2, True)]
    # k1 KL = -0.5 - (-0.25) = -0.25 per token; reward shaping -kl_coef * kl = +0.125 on each of the 3 generated
    # tokens, +1 on the last; REINFORCE++ returns (gamma 1): 1.375, 1.25, 1.125, whitened over the batch
    (first, *_) = trainer.batches[0]
    adv = [a for a, m in zip(first.advantages, first.loss_mask, strict=True) if m]
    assert adv[0] > adv[1] > adv[2]


def test_batch_size_must_split_into_the_steps() -> None:
    with pytest.raises(ValueError, match="multiple of num_steps_per_rollout"):
        LoopSettings(batch_size=6, num_steps_per_rollout=4)


class FailingTrainer(RecordingTrainer):
    """A rank that raises inside ``train_step`` (Ray wraps it in RayTaskError) and is, or is not, still alive."""

    def __init__(self, alive: bool) -> None:
        super().__init__()
        self._alive = alive

    def train_step(self, samples, **kw):
        import ray.exceptions

        raise ray.exceptions.RayTaskError("train_step", "Traceback ...\nValueError: bad setting x",
                                            ValueError("bad setting x")).as_instanceof_cause()

    def alive(self) -> bool:
        return self._alive


@pytest.mark.parametrize("alive", [True, False], ids=["error-in-live-rank", "peer-died"])
def test_an_error_inside_a_live_rank_fails_at_once_a_death_restarts(store, tmp_path: Path, alive: bool) -> None:
    built: list[FailingTrainer] = []

    def make() -> FailingTrainer:
        built.append(FailingTrainer(alive))
        return built[-1]

    lp = TrainLoop(store, make, EngineControl(lambda: []), LoopSettings(batch_size=2, n_samples_per_prompt=2,
                                                                       advantage={"estimator": "grpo"}),
                   tmp_path, job_id="job-x")
    [add(store, f"a{i}", group="A", reward=float(i)) for i in range(2)]
    with pytest.raises(ValueError, match="bad setting x"):
        lp.run(max_restarts=2)
    assert lp.state.restarts == (0 if alive else 2)  # a live rank's error is not repeated; a death is retried
    assert len(built) == (1 if alive else 3)


def test_ppo_scores_values_trains_the_policy_on_gae_then_the_critic(store, tmp_path: Path) -> None:
    lp, trainer = loop(store, tmp_path, batch_size=2, n_samples_per_prompt=1,
                       advantage={"estimator": "gae", "gamma": 1.0, "lam": 1.0})
    add(store, "a", reward=1.0)
    add(store, "b", reward=0.0)
    metrics = lp.step_once()
    assert trainer.scored == [(2, "values")]
    trained, old_values = trainer.critic
    assert old_values == [[0.0, 0.0, 0.0, 0.5, 0.5, 0.5]] * 2  # the values the advantages were computed with
    # GAE (gamma = lambda = 1) on 3 generated tokens of value 0.5: returns are the reward on every step
    by_reward = {s.reward: s for s in trained}
    assert [r for r, m in zip(by_reward[1.0].returns, by_reward[1.0].loss_mask, strict=True) if m] == [1.0] * 3
    assert [r for r, m in zip(by_reward[0.0].returns, by_reward[0.0].loss_mask, strict=True) if m] == [0.0] * 3
    # advantages (return - value = +-0.5) whitened over the batch: +1 and -1
    assert [a for a, m in zip(by_reward[1.0].advantages, by_reward[1.0].loss_mask, strict=True) if m] == \
        pytest.approx([1.0] * 3)
    assert metrics["value_loss"] == 0.125 and metrics["explained_variance"] == pytest.approx(0.0)
    assert trainer.batches[0] == trained  # the policy trained on the same samples first


def test_ppo_critic_steps_on_the_policys_mini_batches(store, tmp_path: Path) -> None:
    """Issue 19: with several optimizer steps per batch the critic takes as many, on the same mini-batches, each
    clipped around the values the advantages were computed with."""
    lp, trainer = loop(store, tmp_path, batch_size=4, n_samples_per_prompt=1, num_steps_per_rollout=2,
                       advantage={"estimator": "gae", "gamma": 1.0, "lam": 1.0})
    for i, r in enumerate((1.0, 0.0, 1.0, 0.0)):
        add(store, f"s{i}", reward=r)
    metrics = lp.step_once()
    assert len(trainer.batches) == 2 and len(trainer.critic_calls) == 2
    for policy_part, (critic_part, old_values) in zip(trainer.batches, trainer.critic_calls, strict=True):
        assert critic_part == policy_part and len(critic_part) == 2
        assert old_values == [[0.0, 0.0, 0.0, 0.5, 0.5, 0.5]] * 2
    assert metrics["critic_steps"] == 2 and metrics["optimizer_steps"] == 2
    assert metrics["value_loss"] == pytest.approx((0.125 + 0.25) / 2)  # averaged over the critic's steps
