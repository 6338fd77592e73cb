"""Export trajectories as slime samples: JSONL always, Parquet when pyarrow is installed.

Why slime's shape: the exported files feed slime-style tooling (replay for debug-train-only,
offline SFT/RL, inspection) without conversion. A line is what slime's ``Sample.to_dict()`` gives and
``Sample.from_dict()`` takes (``slime/utils/types.py``; read at THUDM/slime 624b824): the same field
names with the same types. As in slime, ``tokens`` is the whole sequence and ``loss_mask`` /
``rollout_log_probs`` cover only its last ``response_length`` tokens (from the first generated token to
the end; tool results inside that span have mask 0), ``weight_versions`` has one string per generation
(SGLang's ``meta_info.weight_version``), and ``group_index`` / ``index`` / ``rollout_id`` are ints: numbered
in the order of the export (one int per group, per trajectory, per session), our string ids kept in
``metadata`` (``group_id``, ``trajectory_id``) beside what slime has no field for (the per-token
versions, turns, turn rewards).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from slime_server.buffer.open import is_postgres_url, open_store
from slime_server.buffer.schema import Trajectory, TrajectoryStatus
from slime_server.buffer.store import TrajectoryStore

SampleStatus = Literal["completed", "truncated", "aborted"]


class ExportedSample(BaseModel):
    """One line of the export: the fields of slime's ``Sample`` we can fill, with its types."""

    group_index: int | None
    index: int
    rollout_id: int
    prompt: str = ""  # the store keeps token ids, not the messages: the text is in the tokens
    tokens: list[int]
    response: str = ""
    response_length: int
    label: str | None = None
    reward: float | None
    loss_mask: list[int]
    weight_versions: list[str]
    rollout_log_probs: list[float]
    status: SampleStatus
    metadata: dict[str, Any] = Field(default_factory=dict)
    session_id: str | None
    # slime's MoE field: the engine's top-k experts [positions, layers, topk] of the tokens from the first (all but
    # the last token; None: not recorded)
    rollout_routed_experts: list[list[list[int]]] | None = None
    # slime's multimodal field: what its processor takes, {"images": [...]} in the order of their pads in tokens
    # (each a data URL, from the store's one copy); where each image's pads are: metadata["image_spans"]
    multimodal_inputs: dict[str, list[str]] | None = None


def _sample_status(t: Trajectory) -> SampleStatus:
    if t.status == "aborted":
        return "aborted"
    last = t.turns[-1].finish_reason if t.turns else None
    return {"length": "truncated", "abort": "aborted"}.get(last or "", "completed")


def generation_versions(t: Trajectory) -> list[str]:
    """One version string per generation, as slime appends SGLang's ``meta_info["weight_version"]``: each
    turn's generated tokens, split where the version changes (a continuation after a weight push)."""
    out: list[str] = []
    for turn in t.turns:
        last: int | None = None
        for pos in range(turn.output_start, turn.output_end):
            v = t.weight_versions[pos]
            if t.loss_mask[pos] and v != last:
                out.append(str(v))
                last = v
    return out


class SampleNumbering:
    """The ints slime's ``Sample`` wants for our string ids, numbered in the order samples are written."""

    def __init__(self, store: TrajectoryStore | None = None) -> None:
        self._store = store  # the image files of trajectories that show images
        self._groups: dict[str, int] = {}
        self._sessions: dict[str, int] = {}
        self._next_index = 0

    def sample(self, t: Trajectory) -> ExportedSample:
        n = t.response_length
        start = len(t.tokens) - n
        group = self._groups.setdefault(t.group_id, len(self._groups)) if t.group_id is not None else None
        index, self._next_index = self._next_index, self._next_index + 1
        return ExportedSample(
            group_index=group, index=index, rollout_id=self._sessions.setdefault(t.session_id, len(self._sessions)),
            tokens=t.tokens, response_length=n, reward=t.reward, loss_mask=t.loss_mask[start:],
            weight_versions=generation_versions(t), rollout_log_probs=t.rollout_logprobs[start:],
            status=_sample_status(t), session_id=t.session_id,
            rollout_routed_experts=None if t.routed_experts is None else t.routed_experts.array().tolist(),
            multimodal_inputs=self._images(t),
            metadata={**t.metadata, **({"image_spans": [s.model_dump() for s in t.images]} if t.images else {}), "trajectory_id": t.id, "group_id": t.group_id, "segment": t.segment,
                      "branch": t.branch, "prompt_length": start, "turn_rewards": t.turn_rewards,
                      "token_weight_versions": t.weight_versions[start:],
                      "turns": [turn.model_dump() for turn in t.turns], "consumed_step": t.consumed_step,
                      "consumed_job": t.consumed_job},
        )

    def _images(self, t: Trajectory) -> dict[str, list[str]] | None:
        if not t.images:
            return None
        if self._store is None:
            raise ValueError("exporting a trajectory with images needs the store that holds them")
        blobs = self._store.get_images([s.sha256 for s in t.images])
        return {"images": [f"data:{blobs[s.sha256].mime};base64,{base64.b64encode(blobs[s.sha256].data).decode()}"
                           for s in t.images]}

    def samples(self, trajectories: Iterable[Trajectory]) -> Iterator[ExportedSample]:
        return (self.sample(t) for t in trajectories)


def export_jsonl(store: TrajectoryStore, path: str | Path, status: TrajectoryStatus | None = "finished",
                 *, rewarded: bool | None = None) -> int:
    """Write one JSON object per matching trajectory; returns how many. Written atomically (tmp + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for sample in SampleNumbering(store).samples(store.iter_trajectories(status=status, rewarded=rewarded)):
            # float repr round-trips exactly, so the logprobs in the file are bit-equal to the store's.
            f.write(json.dumps(sample.model_dump(), ensure_ascii=False, allow_nan=True) + "\n")
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
    """Same rows as :func:`export_jsonl` in Parquet (metadata and multimodal_inputs as JSON strings); needs
    ``pyarrow``."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # optional dependency
        raise RuntimeError("Parquet export needs pyarrow: pip install pyarrow") from exc
    rows = []
    for sample in SampleNumbering(store).samples(store.iter_trajectories(status=status, rewarded=rewarded)):
        d = sample.model_dump()
        d["metadata"] = json.dumps(d["metadata"])
        d["multimodal_inputs"] = None if d["multimodal_inputs"] is None else json.dumps(d["multimodal_inputs"])
        rows.append(d)
    schema = pa.schema([
        ("group_index", pa.int64()), ("index", pa.int64()), ("rollout_id", pa.int64()), ("prompt", pa.string()),
        ("tokens", pa.list_(pa.int32())), ("response", pa.string()), ("response_length", pa.int64()),
        ("label", pa.string()), ("reward", pa.float64()), ("loss_mask", pa.list_(pa.int8())),
        ("weight_versions", pa.list_(pa.string())), ("rollout_log_probs", pa.list_(pa.float64())),
        ("status", pa.string()), ("metadata", pa.string()), ("session_id", pa.string()),
        ("rollout_routed_experts", pa.list_(pa.list_(pa.list_(pa.int32())))), ("multimodal_inputs", pa.string()),
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
