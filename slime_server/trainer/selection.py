"""Which buffered trajectories the next train step takes, which it drops, and why it is waiting.

Why apart from the loop: it is pure (trajectories in, a decision out), so every rule is tested on
its own, and the loop keeps reading as the algorithm. The rules, in order, for each group of
finished, rewarded, unconsumed trajectories (oldest first):

- incomplete (fewer than ``group_size`` members): wait for the rest, unless the group has not
  grown for ``group_timeout_s`` seconds; then it is dropped (a client that never completes its
  groups, or an episode that failed, must not hold data, or pacing's buffer, for ever);
- nothing generated: dropped (nothing to learn);
- older than ``max_staleness`` versions with the ``drop`` policy: dropped;
- all rewards equal with ``drop_zero_variance``: dropped (no GRPO signal);
- otherwise taken, whole, until ``batch_size``.

A job that only ever drops groups for the last two reasons can never take a step again (a collapsed policy
that gives every episode reward 0, or one that solves everything): ``check_flat_streak`` fails it with the
reason, rather than let it play episodes for ever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, Field

from slime_server.buffer.schema import Trajectory, TrajectoryHead, oldest_generating_version


def min_version(t: Trajectory) -> int | None:
    """Version of the oldest policy that generated a token of ``t`` (None: nothing generated)."""
    return oldest_generating_version(t.weight_versions)


class Selection(BaseModel):
    """One pass over the pool: the batch (if whole), what to drop, and counts for the wait reason."""

    chosen: list[TrajectoryHead] = Field(default_factory=list)
    lags: list[int] = Field(default_factory=list)
    drop_stale: list[str] = Field(default_factory=list)
    drop_flat: list[str] = Field(default_factory=list)  # zero variance, or nothing generated
    drop_incomplete: list[str] = Field(default_factory=list)
    flat_rewards: list[float | None] = Field(default_factory=list)  # one per flat group: its reward (None: empty)
    incomplete_sessions: int = 0  # sessions whose group is still waiting for members

    def complete(self, batch_size: int) -> bool:
        return len(self.chosen) == batch_size


def select(pool: Sequence[TrajectoryHead], *, batch_size: int, group_size: int, version: int,
           max_staleness: int | None, stale_policy: str, drop_zero_variance: bool,
           group_timeout_s: float | None, now: float,
           lag_of: Callable[[TrajectoryHead, int], int] | None = None) -> Selection:
    """Apply the rules above to ``pool`` (in buffer order) at policy ``version`` and wall time ``now``. ``lag_of(t,
    v)``: how many versions old ``t`` is when generated at ``v`` (default ``version - v``; a per-user job counts
    its user's adapter versions, trainer/user_slots.py)."""
    lag_of = lag_of or (lambda t, v: version - v)
    groups: dict[str, list[TrajectoryHead]] = {}
    for t in pool:
        groups.setdefault(t.group_id or t.id, []).append(t)
    out = Selection()
    for members in groups.values():
        if len(members) < group_size:
            newest = max(t.updated_at for t in members)
            if group_timeout_s is not None and now - newest > group_timeout_s:
                out.drop_incomplete += [t.id for t in members]
            else:
                out.incomplete_sessions += len({t.session_id for t in members})
            continue
        if len(out.chosen) == batch_size:
            continue  # full: the rest only matter for what must be dropped
        members = members[:group_size]
        versions = [t.min_version for t in members]
        if any(v is None for v in versions):
            out.drop_flat += [t.id for t in members]
            out.flat_rewards.append(None)
            continue
        lags = [lag_of(t, v) for t, v in zip(members, versions, strict=True) if v is not None]
        lag = max(lags)
        if max_staleness is not None and lag > max_staleness and stale_policy == "drop":
            out.drop_stale += [t.id for t in members]
            continue
        if drop_zero_variance and len(members) > 1 and len({t.reward for t in members}) == 1:
            out.drop_flat += [t.id for t in members]
            out.flat_rewards.append(members[0].reward)
            continue
        if len(out.chosen) + len(members) > batch_size:
            continue
        out.chosen += members
        out.lags += lags
    return out


class TrainingStalled(RuntimeError):
    """The job can take no step again: every group for a long while carried no signal."""


def check_flat_streak(streak: int, rewards: Sequence[float | None], limit: int | None) -> None:
    """Raise ``TrainingStalled`` once ``streak`` groups in a row, with no step between, were dropped as flat
    (``rewards``: the latest of them, one each; None for a group that generated nothing). ``limit`` None: never."""
    if limit is None or streak < limit:
        return
    seen = sorted({"nothing generated" if r is None else f"{r:g}" for r in rewards})
    raise TrainingStalled(
        f"no step for {streak} groups in a row: every group gave all its members the same reward "
        f"(latest: {', '.join(seen) or '?'}) or generated nothing, so GRPO has no signal. The policy answers every "
        "prompt alike (collapsed, or the task is solved or impossible for it); the job stops rather than play "
        "episodes for ever (loop.max_flat_groups_in_a_row sets how long it waits)")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def wait_reason(selection: Selection, *, batch_size: int, group_size: int, open_rewarded_sessions: int) -> str:
    """What a job that cannot train yet tells its user (status and events)."""
    head = f"waiting for complete groups of {group_size}" if group_size > 1 else "waiting for data"
    parts = [f"{len(selection.chosen)} of {batch_size} samples ready"]
    if group_size > 1:
        parts.append(f"{_count(selection.incomplete_sessions, 'session')} in incomplete groups")
    parts.append(f"{_count(open_rewarded_sessions, 'rewarded session')} still open")
    return f"{head}: " + "; ".join(parts)


class Rejection(BaseModel):
    """Rejection sampling: of each whole group, the samples that train (slime's reward filter, RAFT's best of n).

    ``threshold``: keep samples whose reward is at least this; ``best_of_n``: keep only each group's best (its
    first on a tie), and with a threshold only if the best passes it."""

    threshold: float | None = Field(1.0, description="keep samples with reward >= threshold (None: no threshold)")
    keep: Literal["all_passing", "best_of_n"] = Field("all_passing", description="all samples that pass, or each "
                                                       "group's best if it passes")

    def keep_ids(self, chosen: Sequence[TrajectoryHead | Trajectory]) -> list[str]:
        groups: dict[str, list[TrajectoryHead | Trajectory]] = {}
        for t in chosen:
            groups.setdefault(t.group_id or t.id, []).append(t)
        out: list[str] = []
        for members in groups.values():
            candidates = members
            if self.keep == "best_of_n":
                best = max(members, key=lambda t: float(t.reward or 0.0))
                candidates = [best]
            out += [t.id for t in candidates if self.threshold is None or float(t.reward or 0.0) >= self.threshold]
        return out
