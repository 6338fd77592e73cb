"""A trajectory written as the gateway would, and a recording stand-in for the trainer ranks (outside the
loop's unit): for the tests of trainer/loop.py."""

from __future__ import annotations

from typing import Any

from slime_server.buffer.schema import Trajectory, Turn
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.buffer.store import ResponseRef, TurnWrite


def add(store: SQLiteTrajectoryStore, sid: str, *, group: str | None = None, version: int = 0,
        reward: float | None = 1.0, owner: str | None = None, created_at: float | None = None) -> str:
    store.create_session(sid, group_id=group, owner=owner)
    n = 3
    at = {} if created_at is None else {"created_at": created_at}
    t = Trajectory(**at, session_id=sid, group_id=group or sid, tokens=[5, 6, 7, 8, 9, 10], loss_mask=[0, 0, 0, 1, 1, 1],
                   rollout_logprobs=[0.0] * n + [-0.5] * n, weight_versions=[-1] * n + [version] * n,
                   turns=[Turn(response_id=f"r-{sid}", prompt_start=0, output_start=n, output_end=2 * n,
                               finish_reason="stop")], turn_rewards=[None])
    store.write_turn(TurnWrite(session_id=sid, trajectories=[t],
                               responses=[ResponseRef(response_id=f"r-{sid}", choice=0, trajectory_id=t.id)]))
    store.close_session(sid)
    if reward is not None:
        store.set_reward(sid, reward=reward)
    return t.id


class RecordingTrainer:
    """Stands in for the Megatron ranks: records what it was asked to train and push."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.kwargs: list[dict[str, Any]] = []
        self.pushes: list[int] = []
        self.critic_calls: list[tuple[list[Any], list[list[float]]]] = []
        self.scored: list[tuple[int, bool]] = []

    def train_step(self, samples, **kw):
        self.batches.append(list(samples))
        self.kwargs.append(kw)
        return {"loss": 0.5 * len(self.batches), "ratio_max": float(len(self.batches))}

    def compute_logprobs(self, samples, reference=False):
        self.scored.append((len(samples), reference))
        return [[-0.25 if reference else -0.5] * len(s.tokens) for s in samples]

    def compute_values(self, samples):
        self.scored.append((len(samples), "values"))
        return [[0.5 if m else 0.0 for m in s.loss_mask] for s in samples]

    def train_critic(self, samples, old_values):
        self.critic = (list(samples), [list(v) for v in old_values])
        self.critic_calls.append(self.critic)
        return {"value_loss": 0.125 * len(self.critic_calls)}

    def push_weights(self, urls, version, bucket_bytes=None):
        self.pushes.append(int(version))
        return {"seconds": 0.0, "bytes": 0}

    def save_checkpoint(self, path):
        return path

    def load_checkpoint(self, path):
        return {}

    def shutdown(self):
        pass
