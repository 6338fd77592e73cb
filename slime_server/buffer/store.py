"""The small interface every trajectory store implements (SQLite now, Postgres for many nodes).

Why an interface: the gateway, the session layer, the trainer and the exporters talk to this and
nothing else, so swapping the embedded SQLite file for a shared Postgres changes no caller.
Everything here is expressed in the pydantic records of ``schema.py``; no SQL semantics leak out
(cursors are trajectory ids, concurrency is an explicit revision check, errors are typed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field

from slime_server.buffer.schema import (
    Feedback,
    ImageBlob,
    Session,
    SessionSummary,
    StoredResponse,
    StoreStats,
    Thumb,
    Trajectory,
    TrajectoryHead,
    TrajectoryStatus,
)


class ResponseRef(BaseModel):
    """Which trajectory recorded choice ``choice`` of response ``response_id``."""

    response_id: str
    choice: int
    trajectory_id: str


DROPPED_STEP = -1


class TurnWrite(BaseModel):
    """Everything one chat request changes, written in one transaction.

    ``trajectories`` carry their full new state; each one's ``revision`` is the revision it was read
    at (0 for a trajectory that does not exist yet). The store rejects the whole write with
    ``StaleWriteError`` if any of them changed meanwhile, and stores ``revision + 1``.
    """

    session_id: str
    trajectories: list[Trajectory]
    responses: list[ResponseRef] = Field(default_factory=list)
    segment_split: bool = False
    close_session: bool = False
    create_session: Session | None = Field(
        None, description="insert this session in the same transaction (a one-shot request without a session: "
                          "one fsync instead of two)")
    images: list[ImageBlob] = Field(default_factory=list, description="image files the turn showed, kept once per "
                                    "content hash (one already stored is not written again)")


class TrajectoryStore(ABC):
    """Durable sessions, trajectories, rewards and feedback. Every write is committed on return."""

    # ---------------------------------------------------------------- sessions
    @abstractmethod
    def create_session(self, session_id: str | None = None, *, group_id: str | None = None,
                       metadata: dict[str, Any] | None = None, key_hash: str | None = None,
                       owner: str | None = None) -> Session:
        """Create a session (a fresh id when none is given); ``SessionExistsError`` if taken."""

    @abstractmethod
    def get_session(self, session_id: str) -> Session:
        """The session, or ``SessionNotFound``."""

    @abstractmethod
    def get_or_create_session(self, session_id: str, *, group_id: str | None = None,
                              metadata: dict[str, Any] | None = None, owner: str | None = None) -> Session:
        """Sessions named by a client header come into being on first use (owned by ``owner``).

        With ``owner`` set, an existing session owned by anyone else raises ``SessionForbidden``."""

    @abstractmethod
    def close_session(self, session_id: str) -> Session:
        """Close the session and finish its open trajectories (idempotent)."""

    @abstractmethod
    def close_idle_sessions(self, idle_since: float, limit: int = 1000) -> list[str]:
        """Close up to ``limit`` open sessions last written before ``idle_since`` (epoch seconds), oldest
        first, finishing their open trajectories; returns their ids. Why: an agent that never closes its
        sessions must not leave its rewarded episodes out of training for ever."""

    # ---------------------------------------------------------------- trajectories
    @abstractmethod
    def get_trajectories(self, session_id: str) -> list[Trajectory]:
        """All trajectories of a session, ordered by (segment, branch); ``SessionNotFound`` if unknown."""

    @abstractmethod
    def get_trajectory(self, trajectory_id: str) -> Trajectory:
        """One trajectory, or ``TrajectoryNotFound``."""

    @abstractmethod
    def write_turn(self, write: TurnWrite) -> list[Trajectory]:
        """Apply a turn atomically and durably; returns the trajectories as stored."""

    @abstractmethod
    def get_images(self, hashes: list[str]) -> dict[str, ImageBlob]:
        """The stored image files among ``hashes`` (by content hash; those never stored are absent)."""

    @abstractmethod
    def find_by_response_id(self, response_id: str) -> list[tuple[Trajectory, int]]:
        """(trajectory, turn index) for every choice of a response; ``ResponseNotFound`` if unknown."""

    @abstractmethod
    def list_trajectories(self, *, status: TrajectoryStatus | None = None, rewarded: bool | None = None,
                          unconsumed: bool | None = None, session_id: str | None = None,
                          limit: int = 100, after: str | None = None) -> list[Trajectory]:
        """Trajectories in write order; ``after`` is the id of the last one of the previous page."""

    @abstractmethod
    def list_heads(self, *, status: TrajectoryStatus | None = None, rewarded: bool | None = None,
                   unconsumed: bool | None = None, limit: int = 100) -> list[TrajectoryHead]:
        """What :meth:`list_trajectories` lists with the same filters, as heads (no token arrays, no messages)."""

    @abstractmethod
    def get_trajectories_by_id(self, trajectory_ids: list[str]) -> list[Trajectory]:
        """The trajectories, whole, in the order asked; ``TrajectoryNotFound`` if one is unknown."""

    def iter_trajectories(self, *, page_size: int = 256, **filters: Any) -> Iterator[Trajectory]:
        """Every trajectory matching ``filters``, paging through :meth:`list_trajectories`."""
        after: str | None = None
        while True:
            page = self.list_trajectories(limit=page_size, after=after, **filters)
            yield from page
            if len(page) < page_size:
                return
            after = page[-1].id

    @abstractmethod
    def mark_consumed(self, trajectory_ids: list[str], train_step: int, job_id: str | None = None) -> int:
        """Record that the trainer (of ``job_id``) used these at ``train_step``; returns how many were newly marked.

        ``train_step`` ``DROPPED_STEP`` (-1) records a trajectory the trainer decided never to train on
        (too stale, a zero-variance group): it leaves the pool but stays stored and exportable.
        """

    @abstractmethod
    def release_consumed(self, after_step: int, job_id: str | None = None) -> int:
        """Put back into the pool every trajectory that ``job_id`` consumed in a step ``> after_step``.

        Why: a trainer that restarts from the checkpoint of ``after_step`` lost the steps after it;
        their data must be trained on again, not silently skipped. Dropped ones stay dropped.
        """

    # ---------------------------------------------------------------- rewards and feedback
    @abstractmethod
    def set_reward(self, session_id: str, *, reward: float | None = None,
                   turn_rewards: list[float] | None = None, idempotency_key: str | None = None,
                   finish: bool = False) -> bool:
        """Apply a reward to the session's trajectories (and with ``finish`` close the session in the same
        transaction: the reward is the episode's outcome).

        ``reward`` sets every trajectory's scalar reward; ``turn_rewards[i]`` is the reward of the
        session's i-th response (commit order) and lands on the turns that recorded it. A later
        event overrides an earlier one (last write wins). Returns True if applied, False if
        ``idempotency_key`` was already applied with the same payload (``IdempotencyConflict`` if
        with a different one). Without a key every call applies.
        """

    @abstractmethod
    def add_feedback(self, response_id: str, *, thumb: Thumb | None = None, score: float | None = None,
                     comment: str | None = None) -> Feedback:
        """Attach user feedback to a response; ``ResponseNotFound`` if unknown."""

    @abstractmethod
    def get_feedback(self, response_id: str) -> list[Feedback]:
        """Feedback recorded for a response, oldest first."""

    # ---------------------------------------------------------------- stored API responses
    @abstractmethod
    def put_stored_response(self, response: StoredResponse) -> None:
        """Keep a stateful API's response (insert or replace by id)."""

    @abstractmethod
    def get_stored_response(self, response_id: str) -> StoredResponse:
        """A kept response; ``ResponseNotFound`` if unknown."""

    # ---------------------------------------------------------------- housekeeping
    @abstractmethod
    def recent_sessions(self, limit: int) -> list[SessionSummary]:
        """Newest sessions first (by creation time, then id), with their trajectory count, tokens and
        the newest trajectory's reward: the dashboard's list."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """Counts for /metrics and the dashboard."""

    @abstractmethod
    def count_open_rewarded_sessions(self) -> int:
        """Open sessions with a rewarded, untrained trajectory: what a job waiting for whole groups reports."""

    @abstractmethod
    def count_ready(self) -> int:
        """Finished, rewarded, untrained trajectories: what buffer pacing counts (``stats()``'s
        ``unconsumed_finished_rewarded``, read from the pick index instead of the whole store)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""
