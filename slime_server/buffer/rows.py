"""Row codecs of the trajectory store (the same on SQLite and PostgreSQL).

Why one module: both stores lay a trajectory out the same way (little-endian token arrays, JSON
for the rest), so a row moves between them byte for byte and they cannot drift apart. Rows are
anything indexable by column name (``sqlite3.Row``, psycopg's ``dict_row``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.buffer.schema import (
    ImageSpan,
    NormalizedMessage,
    Session,
    SessionForbidden,
    Trajectory,
    TrajectoryHead,
    Turn,
    oldest_generating_version,
)

Row = Any

TRAJ_COLUMNS = ("id, session_id, segment, branch, group_id, tokens, loss_mask, rollout_logprobs, "
                "weight_versions, routed_experts, images, turns, messages, tools_digest, reward, turn_rewards, status, "
                "consumed_step, consumed_job, metadata, revision, created_at, updated_at")
HEAD_COLUMNS = "id, session_id, group_id, reward, created_at, updated_at, weight_versions"
SESSION_COLUMNS = "id, group_id, metadata, status, key_hash, owner, segment_splits, created_at, updated_at"


def pack(values: list[int] | list[float], dtype: str) -> bytes:
    """Little-endian bytes: float64 logprobs round-trip bit-exactly."""
    return np.asarray(values, dtype=dtype).tobytes()


def unpack(blob: bytes, dtype: str) -> list[Any]:
    return np.frombuffer(blob, dtype=dtype).tolist()


def session_from_row(row: Row) -> Session:
    return Session(id=row["id"], group_id=row["group_id"], metadata=json.loads(row["metadata"]),
                   status=row["status"], key_hash=row["key_hash"], owner=row["owner"],
                   segment_splits=row["segment_splits"], created_at=row["created_at"], updated_at=row["updated_at"])


def owned(session: Session, owner: str | None) -> Session:
    """``session`` if a caller recording as ``owner`` (None: admin) may use it."""
    if owner is not None and session.owner != owner:
        raise SessionForbidden(f"session {session.id!r} belongs to another API key")
    return session


def traj_from_row(row: Row) -> Trajectory:
    """A stored trajectory, not validated again: every row was written from a validated ``Trajectory``, and checking
    its four token-length lists again cost ~6 ms per read of a 72k-token agent trace, read twice a turn (the
    gateway's prepare and commit). Its turns and messages are still parsed into their models."""
    return Trajectory.model_construct(
        id=row["id"], session_id=row["session_id"], segment=row["segment"], branch=row["branch"],
        group_id=row["group_id"], tokens=unpack(row["tokens"], "<i4"), loss_mask=unpack(row["loss_mask"], "u1"),
        rollout_logprobs=unpack(row["rollout_logprobs"], "<f8"),
        weight_versions=unpack(row["weight_versions"], "<i8"), routed_experts=RoutedExperts.unpack(row["routed_experts"]),
        turns=[Turn.model_validate(t) for t in json.loads(row["turns"])],
        images=[ImageSpan.model_validate(s) for s in json.loads(row["images"] or "[]")],
        messages=[NormalizedMessage.model_validate(m) for m in json.loads(row["messages"])],
        tools_digest=row["tools_digest"], reward=row["reward"], turn_rewards=json.loads(row["turn_rewards"]),
        status=row["status"], consumed_step=row["consumed_step"], consumed_job=row["consumed_job"],
        metadata=json.loads(row["metadata"]),
        revision=row["revision"], created_at=row["created_at"], updated_at=row["updated_at"])


def head_from_row(row: Row) -> TrajectoryHead:
    """A trajectory's head from its row: the generating versions are read from the arrays' bytes directly."""
    return TrajectoryHead(id=row["id"], session_id=row["session_id"], group_id=row["group_id"], reward=row["reward"],
                          created_at=row["created_at"], updated_at=row["updated_at"],
                          min_version=oldest_generating_version(np.frombuffer(row["weight_versions"], dtype="<i8")))


def traj_params(t: Trajectory, revision: int, updated_at: float) -> dict[str, Any]:
    return {
        "id": t.id, "session_id": t.session_id, "segment": t.segment, "branch": t.branch, "group_id": t.group_id,
        "n_tokens": len(t.tokens), "tokens": pack(t.tokens, "<i4"), "loss_mask": pack(t.loss_mask, "u1"),
        "rollout_logprobs": pack(t.rollout_logprobs, "<f8"), "weight_versions": pack(t.weight_versions, "<i8"),
        "routed_experts": None if t.routed_experts is None else t.routed_experts.pack(),
        "turns": json.dumps([x.model_dump() for x in t.turns]),
        "images": json.dumps([s.model_dump() for s in t.images]) if t.images else None,
        "messages": json.dumps([m.model_dump(exclude_defaults=True) for m in t.messages]),
        "tools_digest": t.tools_digest, "reward": t.reward, "turn_rewards": json.dumps(t.turn_rewards),
        "status": t.status, "consumed_step": t.consumed_step, "metadata": json.dumps(t.metadata),
        "revision": revision, "created_at": t.created_at, "updated_at": updated_at, "old_revision": t.revision,
    }

