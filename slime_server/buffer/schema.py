"""Records of the trajectory buffer (ARCHITECTURE decision 6), as pydantic models.

Why pydantic: these are the wire format between the gateway, the store, the trainer and the
exporters; one validated shape keeps a SQLite store and a future Postgres store interchangeable.
Token arrays are plain lists here; how a store lays them out on disk is its own business.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator

from slime_server.buffer.routed_experts import RoutedExperts

SessionStatus = Literal["open", "closed"]
TrajectoryStatus = Literal["open", "finished", "aborted"]
Thumb = Literal["up", "down"]


def now() -> float:
    return time.time()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StoreError(Exception):
    """Base of the store's typed errors; ``status_code`` is what the gateway answers."""

    status_code = 400
    code = "invalid_request"


class NotFoundError(StoreError, LookupError):
    """An id the store has never seen: 404, and the store is unchanged."""

    status_code = 404
    code = "not_found"


class SessionNotFound(NotFoundError):
    code = "session_not_found"  # a session id in a header, a path or a reward


class TrajectoryNotFound(NotFoundError):
    code = "trajectory_not_found"


class ResponseNotFound(NotFoundError):
    code = "response_not_found"


class SessionForbidden(StoreError):
    """The caller's key does not own the session it named (agent keys reach only their own)."""

    status_code = 403
    code = "session_forbidden"


class ConflictError(StoreError):
    """The write contradicts what is stored; nothing of it was applied (the transaction rolled back)."""

    status_code = 409
    code = "conflict"


class SessionClosedError(ConflictError):
    code = "session_closed"  # a turn for a session whose episode is over (a final reward, a close, idle)


class SessionExistsError(ConflictError):
    code = "session_exists"


class IdempotencyConflict(ConflictError):
    """The idempotency key was already used with a different payload."""

    code = "idempotency_key_reused"


class StaleWriteError(ConflictError):
    """A trajectory changed between read and write (optimistic concurrency); the caller retries."""

    code = "stale_write"


class StoreUnavailable(StoreError):
    """The store cannot take writes (disk full, read-only, I/O error): the request failed, nothing was
    half-written (the transaction rolled back), and the same request can succeed once the fault is fixed."""

    status_code = 503
    code = "store_unavailable"


class ToolCallRef(BaseModel):
    """A tool call as rendered: ``arguments`` is the exact JSON text the model produced."""

    id: str | None = None
    name: str
    arguments: str


class MessageImage(BaseModel):
    """An image in a message: its content hash (sha256 of the image file's bytes) and the pad tokens it takes in the
    served model's prompt. Its place in the message is the placeholder in ``content`` (gateway/images.py)."""

    sha256: str
    tokens: int


class ImageSpan(BaseModel):
    """An image in a trajectory's tokens: ``tokens[offset:offset + length]`` are its pads."""

    sha256: str
    offset: int
    length: int


class ImageBlob(BaseModel):
    """An image file as the store keeps it: once per content hash, whatever sessions show it."""

    sha256: str
    mime: str
    width: int
    height: int
    data: bytes


class NormalizedMessage(BaseModel):
    """One chat message in the canonical shape shared by the renderer and the session matcher."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[MessageImage] = Field(default_factory=list)  # in the order of their placeholders in content
    reasoning_content: str | None = None
    tool_calls: list[ToolCallRef] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


class Session(BaseModel):
    id: str
    group_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    status: SessionStatus = "open"
    key_hash: str | None = None
    owner: str | None = None  # the agent key that created it (api/auth.py); None: admin/open
    # Times a request could not extend any earlier trajectory and began a new segment (decision 3).
    segment_splits: int = 0
    created_at: float = Field(default_factory=now)
    updated_at: float = Field(default_factory=now)


class Turn(BaseModel):
    """One generated response inside a trajectory: ``tokens[prompt_start:output_start]`` is the
    context this turn added (loss mask 0), ``tokens[output_start:output_end]`` what it generated."""

    response_id: str
    choice: int = 0  # index of the choice within its response (n > 1 makes sibling branches)
    prompt_start: int
    output_start: int
    output_end: int
    finish_reason: str | None = None
    tool_calls: list[ToolCallRef] = Field(default_factory=list)
    grammar: dict[str, str] | None = Field(
        None, description="the SGLang grammar (json_schema or ebnf) its tokens were decoded under. Their recorded "
        "log-probs are the grammar-masked distribution's, so they are stored at loss mask 0 (a consumer that cannot "
        "apply the grammar leaves them out); this server's trainer rebuilds the masks and trains on them under the "
        "same masks (trainer/grammar_masks.py)")
    lora_adapter: str | None = Field(None, description="the LoRA adapter that generated its tokens, by the engines' "
                                     "name: a published alias's version (``<alias>@<job>.v<n>``), whose version is "
                                     "also its tokens' weight version, or the adapter the request named; None: the "
                                     "base model")
    created_at: float = Field(default_factory=now)


class Trajectory(BaseModel):
    """One token sequence the trainer can learn from: a segment/branch of a session."""

    id: str = Field(default_factory=lambda: new_id("traj"))
    session_id: str
    segment: int = 0
    branch: int = 0
    group_id: str | None = None
    tokens: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    rollout_logprobs: list[float] = Field(default_factory=list)
    weight_versions: list[int] = Field(default_factory=list)
    routed_experts: RoutedExperts | None = Field(None, description="an MoE model's routed experts of the first "
                                                 "positions (all but the last token), from the engines' answers")
    turns: list[Turn] = Field(default_factory=list)
    images: list[ImageSpan] = Field(default_factory=list)  # a vision-language model's images among the tokens
    # Normalised conversation so far (last request's messages + the assistant message returned), and
    # a digest of the tools it was rendered with: what rule (b) of decision 3 compares against.
    messages: list[NormalizedMessage] = Field(default_factory=list)
    tools_digest: str | None = None
    reward: float | None = None
    turn_rewards: list[float | None] = Field(default_factory=list)
    status: TrajectoryStatus = "open"
    consumed_step: int | None = None
    consumed_job: str | None = None  # the job whose step consumed (or dropped) it; read-only here
    metadata: dict[str, Any] = Field(default_factory=dict)
    revision: int = 0  # bumped on every write; optimistic concurrency for the store
    created_at: float = Field(default_factory=now)
    updated_at: float = Field(default_factory=now)

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        n = len(self.tokens)
        if not (len(self.loss_mask) == len(self.rollout_logprobs) == len(self.weight_versions) == n):
            raise ValueError("tokens, loss_mask, rollout_logprobs and weight_versions must have equal length")
        if self.routed_experts is not None and self.routed_experts.positions > n:
            raise ValueError(f"routed experts of {self.routed_experts.positions} positions for {n} tokens")
        if not set(self.loss_mask) <= {0, 1}:  # in C: a generator over a long trace cost ms
            raise ValueError("loss_mask holds only 0 and 1")
        return self

    @property
    def consumed(self) -> bool:
        return self.consumed_step is not None

    @property
    def response_length(self) -> int:
        """slime's ``response_length``: tokens from the first generated token to the end."""
        first = next((t.output_start for t in self.turns), len(self.tokens))
        return len(self.tokens) - first

    def head(self) -> TrajectoryHead:
        return TrajectoryHead(id=self.id, session_id=self.session_id, group_id=self.group_id, reward=self.reward,
                              created_at=self.created_at, updated_at=self.updated_at,
                              min_version=oldest_generating_version(self.weight_versions))


def oldest_generating_version(weight_versions: Any) -> int | None:
    """The oldest policy version that generated a token (version known: context tokens have none); None: none
    generated. A token decoded under a grammar counts though its loss mask is 0 (``Turn.grammar``: the trainer
    rebuilds its masks and trains it): a job on forced tool calls must not see its episodes as empty. One rule for
    a trajectory in memory (lists) and for its stored row (the arrays' bytes, ``buffer/rows.py``)."""
    versions = np.asarray(weight_versions, dtype=np.int64)
    generated = versions[versions >= 0]
    return int(generated.min()) if generated.size else None


class TrajectoryHead(BaseModel):
    """What choosing a batch reads of a buffered trajectory (``trainer/selection.py``): no token arrays, no
    messages. Why: the loop looks at the whole unconsumed pool on every poll (5 a second by default) and trains
    on a few of its members; it reads those whole, by id, once chosen."""

    id: str
    session_id: str
    group_id: str | None = None
    reward: float | None = None
    created_at: float  # its first turn's time: a per-user job drops a forgotten user's conversations begun before
    updated_at: float
    min_version: int | None = None  # the oldest policy that generated one of its tokens (None: none generated)


class RewardEvent(BaseModel):
    """A reward as it arrived; ``idempotency_key`` is unique across the store."""

    idempotency_key: str
    session_id: str
    reward: float | None = None
    turn_rewards: list[float] | None = None
    created_at: float = Field(default_factory=now)

    def payload(self) -> tuple[float | None, list[float] | None]:
        return self.reward, self.turn_rewards


class Feedback(BaseModel):
    id: str = Field(default_factory=lambda: new_id("fb"))
    response_id: str
    session_id: str
    thumb: Thumb | None = None
    score: float | None = None
    comment: str | None = None
    created_at: float = Field(default_factory=now)


class StoredResponse(BaseModel):
    """A stateful API's stored answer (OpenAI Responses ``store: true``): what ``previous_response_id``
    continues and ``GET /v1/responses/{id}`` returns. ``body`` is the API's own record (its input
    messages, output message and the response object); the tokens live in the trajectory."""

    id: str
    session_id: str
    owner: str | None = None
    previous_response_id: str | None = None
    body: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=now)


class SessionSummary(BaseModel):
    """One line of a session listing (the dashboard's): counts instead of the token arrays."""

    id: str
    status: SessionStatus
    group_id: str | None = None
    created_at: float
    updated_at: float
    metadata: dict[str, Any] = Field(default_factory=dict)
    num_trajectories: int = 0
    num_tokens: int = 0
    reward: float | None = Field(None, description="reward of the newest rewarded trajectory")


class StoreStats(BaseModel):
    sessions: int = 0
    open_sessions: int = 0
    trajectories: dict[str, int] = Field(default_factory=dict)  # by status
    rewarded: int = 0
    unconsumed_finished_rewarded: int = 0
    tokens: int = 0
    segment_splits: int = 0
    feedback: int = 0
