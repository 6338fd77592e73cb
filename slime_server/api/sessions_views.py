"""Response shapes of ``GET /v1/sessions/{id}`` and ``…/trajectory`` (built from buffer records).

Why separate views: the stored records carry internals (revision counters, normalised message
copies, key hashes) that are not part of the public API; these models are the contract.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class TurnView(BaseModel):
    response_id: str
    prompt_start: int
    output_start: int
    output_end: int
    finish_reason: str | None = None
    lora_adapter: str | None = None  # the LoRA adapter that generated it (None: the base)


class ImageSpanView(BaseModel):
    """An image among a trajectory's tokens: ``tokens[offset:offset + length]`` are its pads; the file is stored once
    by ``sha256``."""

    sha256: str
    offset: int
    length: int


class TrajectoryView(BaseModel):
    id: str
    session_id: str
    segment: int
    branch: int
    group_id: str | None = None
    status: str
    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    weight_versions: list[int]
    turns: list[TurnView]
    images: list[ImageSpanView] = []
    reward: float | None = None
    turn_rewards: list[float | None] = []
    num_tokens: int
    num_generated_tokens: int
    metadata: dict[str, Any] = {}


class TrajectorySummary(BaseModel):
    id: str
    segment: int
    branch: int
    status: str
    num_turns: int
    num_tokens: int
    num_generated_tokens: int
    reward: float | None = None


class SessionView(BaseModel):
    id: str
    object: str = "session"
    group_id: str | None = None
    status: str
    metadata: dict[str, Any] = {}
    user: str | None = Field(None, description="whose session: the agent key (key:<id>) or a front end's user "
                             "(key:<front end>/<user>); None for the admin's, the shared key's and open access")
    segment_splits: int = 0
    num_turns: int
    num_tokens: int
    num_generated_tokens: int
    rewards: list[float | None]
    trajectories: list[TrajectorySummary]
    created_at: float
    updated_at: float


def trajectory_view(t: Any) -> TrajectoryView:
    return TrajectoryView(
        id=t.id, session_id=t.session_id, segment=t.segment, branch=t.branch, group_id=t.group_id,
        status=t.status, tokens=t.tokens, loss_mask=t.loss_mask, rollout_logprobs=t.rollout_logprobs,
        weight_versions=t.weight_versions, turns=[TurnView.model_validate(x, from_attributes=True) for x in t.turns],
        images=[ImageSpanView.model_validate(s, from_attributes=True) for s in getattr(t, "images", [])],
        reward=t.reward, turn_rewards=list(t.turn_rewards), num_tokens=len(t.tokens),
        num_generated_tokens=sum(t.loss_mask), metadata=t.metadata)


def session_view(s: Any, trajs: list[Any]) -> SessionView:
    return SessionView(
        id=s.id, group_id=s.group_id, status=s.status, metadata=s.metadata, segment_splits=s.segment_splits,
        user=s.owner if (s.owner or "").startswith("key:") else None,
        num_turns=sum(len(t.turns) for t in trajs), num_tokens=sum(len(t.tokens) for t in trajs),
        num_generated_tokens=sum(sum(t.loss_mask) for t in trajs), rewards=[t.reward for t in trajs],
        trajectories=[TrajectorySummary(id=t.id, segment=t.segment, branch=t.branch, status=t.status,
                                        num_turns=len(t.turns), num_tokens=len(t.tokens),
                                        num_generated_tokens=sum(t.loss_mask), reward=t.reward) for t in trajs],
        created_at=s.created_at, updated_at=s.updated_at)
