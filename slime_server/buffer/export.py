"""Export trajectories as slime samples: JSONL always, Parquet when pyarrow is installed.

Why slime's shape: the exported files feed slime-style tooling (replay for debug-train-only,
offline SFT/RL, inspection) without conversion. As in slime's ``Sample``, ``tokens`` is the whole
sequence and ``loss_mask`` / ``rollout_log_probs`` cover only its last ``response_length`` tokens
(from the first generated token to the end; tool results inside that span have mask 0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from slime_server.buffer.schema import Trajectory, TrajectoryStatus
from slime_server.buffer.store import TrajectoryStore


class ExportedSample(BaseModel):
    """One line of the export: slime's sample fields plus where it came from."""

    group_index: str | None
    index: str
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    weight_versions: list[int]
    reward: float | None
    status: str  # slime's: completed | truncated | aborted
    metadata: dict[str, Any] = Field(default_factory=dict)


def _sample_status(t: Trajectory) -> str:
    if t.status == "aborted":
        return "aborted"
    last = t.turns[-1].finish_reason if t.turns else None
    return {"length": "truncated", "abort": "aborted"}.get(last or "", "completed")


def to_sample(t: Trajectory) -> ExportedSample:
    n = t.response_length
    start = len(t.tokens) - n
    return ExportedSample(
        group_index=t.group_id, index=t.id, tokens=t.tokens, response_length=n, loss_mask=t.loss_mask[start:],
        rollout_log_probs=t.rollout_logprobs[start:], weight_versions=t.weight_versions[start:], reward=t.reward,
        status=_sample_status(t),
        metadata={**t.metadata, "session_id": t.session_id, "segment": t.segment, "branch": t.branch,
                  "prompt_length": start, "turn_rewards": t.turn_rewards,
                  "turns": [turn.model_dump() for turn in t.turns], "consumed_step": t.consumed_step},
    )


def export_jsonl(store: TrajectoryStore, path: str | Path, status: TrajectoryStatus | None = "finished",
                 *, rewarded: bool | None = None) -> int:
    """Write one JSON object per matching trajectory; returns how many. Written atomically (tmp + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for t in store.iter_trajectories(status=status, rewarded=rewarded):
            # float repr round-trips exactly, so the logprobs in the file are bit-equal to the store's.
            f.write(json.dumps(to_sample(t).model_dump(), ensure_ascii=False, allow_nan=True) + "\n")
            count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return count


def read_jsonl(path: str | Path) -> list[ExportedSample]:
    with open(path, encoding="utf-8") as f:
        return [ExportedSample.model_validate_json(line) for line in f if line.strip()]


def export_parquet(store: TrajectoryStore, path: str | Path, status: TrajectoryStatus | None = "finished",
                   *, rewarded: bool | None = None) -> int:
    """Same rows as :func:`export_jsonl` in Parquet (metadata as a JSON string); needs ``pyarrow``."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # optional dependency
        raise RuntimeError("Parquet export needs pyarrow: pip install pyarrow") from exc
    rows = []
    for t in store.iter_trajectories(status=status, rewarded=rewarded):
        d = to_sample(t).model_dump()
        d["metadata"] = json.dumps(d["metadata"])
        rows.append(d)
    schema = pa.schema([
        ("group_index", pa.string()), ("index", pa.string()), ("tokens", pa.list_(pa.int32())),
        ("response_length", pa.int64()), ("loss_mask", pa.list_(pa.int8())),
        ("rollout_log_probs", pa.list_(pa.float64())), ("weight_versions", pa.list_(pa.int64())),
        ("reward", pa.float64()), ("status", pa.string()), ("metadata", pa.string()),
    ])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return len(rows)


class ExportCommand:
    """``slime-server export``: finished (by default) trajectories of a store to JSONL or Parquet."""

    help = "export trajectories from the trajectory store as slime samples (JSONL or Parquet)"

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--db-path", default=None,
                            help="SQLite file or postgresql:// URL (default: settings gateway.db_path)")
        parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
        parser.add_argument("--output", "-o", default=None, help="file to write (default: trajectories.<format>)")
        parser.add_argument("--status", choices=("finished", "open", "aborted", "all"), default="finished")
        parser.add_argument("--rewarded-only", action="store_true", help="only trajectories that have a reward")

    def run(self, args: Any, settings: Any) -> int:
        import sys

        from slime_server.buffer.open import is_postgres_url, open_store

        db = args.db_path or settings.gateway.db_path
        if not is_postgres_url(db) and not Path(db).is_file():  # never create an empty store by mistake
            print(f"error: no trajectory store at {db}", file=sys.stderr)
            return 2
        out = Path(args.output or f"trajectories.{args.format}")
        status = None if args.status == "all" else args.status
        store = open_store(str(db))
        try:
            fn = export_jsonl if args.format == "jsonl" else export_parquet
            try:
                n = fn(store, out, status, rewarded=True if args.rewarded_only else None)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        finally:
            store.close()
        print(f"exported {n} trajectories to {out}", flush=True)
        return 0
