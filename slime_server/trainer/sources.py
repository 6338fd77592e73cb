"""Batches from files, for the jobs that do not train on the live buffer.

- ``ConversationSource``: SFT on a JSONL of conversations (OpenAI ``messages`` with ``tools`` and tool turns,
  or slime's prompt / label rows mapped by key), rendered with the served model's own chat template so the
  loss falls on exactly the tokens the policy will generate (``trainer/sft.py``'s ``conversation_sample``).
- ``ReplaySource``: the train-only debug mode (slime's ``--debug-train-only`` on saved rollouts): an export
  (``buffer/export.py``, slime's ``Sample`` lines) trained again with its recorded tokens, masks, log-probs,
  rewards and groups. Where the export says which step of which job consumed each sample, the batches are
  that job's, in its order, so a training bug is reproduced from a file step by step.

Why step-indexed: batch ``k`` is a pure function of ``k`` (and the seed), so a job restored from the checkpoint
of step ``k`` goes on with batch ``k``, and the same file and seed give the same batches, hence the same loss
curve.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slime_server.buffer.export import read_jsonl
from slime_server.trainer.loop import Batch
from slime_server.trainer.sft import conversation_sample
from slime_server.trainer.types import TrainSample


class SourceError(ValueError):
    """A data file a job cannot train on (said at submit time, in the spec's words)."""


def read_conversations(path: str | Path, *, input_key: str = "messages", label_key: str | None = None,
                       tools_key: str = "tools", system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Rows as ``{"messages": [...], "tools": [...] | None}``.

    ``label_key`` unset: ``row[input_key]`` is the conversation (assistant turns are the targets). Set: slime's
    mapping, ``row[input_key]`` is the prompt (a string, or messages) and ``row[label_key]`` the answer."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or input_key not in row:
                raise SourceError(f"{path}:{n}: no {input_key!r} field")
            value = row[input_key]
            messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise SourceError(f"{path}:{n}: {input_key!r} must be a string or a list of messages with roles")
            if label_key is not None:
                if label_key not in row:
                    raise SourceError(f"{path}:{n}: no {label_key!r} field")
                messages = [*messages, {"role": "assistant", "content": str(row[label_key])}]
            if system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system_prompt}, *messages]
            if not any(m["role"] == "assistant" for m in messages):
                raise SourceError(f"{path}:{n}: no assistant message to train on")
            tools = row.get(tools_key)
            rows.append({"messages": messages, "tools": tools if isinstance(tools, list) and tools else None})
    if not rows:
        raise SourceError(f"{path}: no rows")
    return rows


class ConversationSource:
    """SFT batches: ``epochs`` passes over the rows, each in its own seeded order, cut into ``batch_size``."""

    def __init__(self, samples: Sequence[TrainSample], *, batch_size: int, epochs: int = 1, seed: int = 0) -> None:
        if not samples:
            raise SourceError("no conversations to train on")
        self.samples, self.batch_size, self.seed = list(samples), batch_size, seed
        order: list[int] = []
        for epoch in range(epochs):
            perm = list(range(len(self.samples)))
            random.Random(seed * 1_000_003 + epoch).shuffle(perm)
            order += perm
        self.order = order
        self.steps = -(-len(order) // batch_size)

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Any, *, batch_size: int, epochs: int = 1, seed: int = 0,
                  **keys: Any) -> ConversationSource:
        samples = []
        for i, row in enumerate(read_conversations(path, **keys)):
            try:
                samples.append(conversation_sample(tokenizer, row["messages"], row["tools"]))
            except (ValueError, KeyError, TypeError) as e:
                raise SourceError(f"{path}: row {i + 1} cannot be rendered with the served model's chat template: "
                                  f"{e}") from e
        return cls(samples, batch_size=batch_size, epochs=epochs, seed=seed)

    def batch(self, step: int, version: int) -> Batch | None:
        if step >= self.steps:
            return None
        picked = [self.samples[i] for i in self.order[step * self.batch_size:(step + 1) * self.batch_size]]
        return Batch(samples=picked, lags=[0] * len(picked))


def exported_train_sample(line: Any) -> TrainSample:
    """One exported ``Sample`` back to the trainer's shape: the prompt part of every per-token list restored
    (mask 0, log-prob 0.0, version -1) in front of the response part the export keeps."""
    prompt = len(line.tokens) - line.response_length
    meta = line.metadata
    versions = meta.get("token_weight_versions")
    if not isinstance(versions, list) or len(versions) != line.response_length:
        # a file from elsewhere (slime's own dump): one version per generation; the newest for every token
        newest = max((int(v) for v in line.weight_versions if str(v).lstrip("-").isdigit()), default=0)
        versions = [newest if m else -1 for m in line.loss_mask]
    group = meta.get("group_id") or (f"group-{line.group_index}" if line.group_index is not None else None)
    return TrainSample(tokens=line.tokens, loss_mask=[0] * prompt + list(line.loss_mask),
                       rollout_logprobs=[0.0] * prompt + list(line.rollout_log_probs),
                       weight_versions=[-1] * prompt + [int(v) for v in versions], reward=float(line.reward or 0.0),
                       group_id=group, sample_id=meta.get("trajectory_id") or f"sample-{line.index}")


class ReplaySource:
    """Train-only batches from an export: the original job's batches when the file records them, else whole
    groups in file order, ``batch_size`` samples each (a group that does not fit the rest is left out)."""

    def __init__(self, path: str | Path, *, batch_size: int, group_size: int = 1, job_id: str | None = None) -> None:
        try:
            lines = read_jsonl(path)
        except (OSError, ValueError) as e:
            raise SourceError(f"{path}: not an export of slime samples ({e})"[:500]) from e
        lines = [x for x in lines if x.reward is not None and x.response_length > 0 and any(x.loss_mask)]
        if job_id is not None:  # what that job trained on (not what it dropped)
            lines = [x for x in lines if x.metadata.get("consumed_job") == job_id
                     and isinstance(x.metadata.get("consumed_step"), int) and x.metadata["consumed_step"] > 0]
            if not lines:
                raise SourceError(f"{path}: no sample was trained by job {job_id!r}")
        steps = [x.metadata.get("consumed_step") for x in lines]
        jobs = {x.metadata.get("consumed_job") for x in lines}
        self.recorded = len(jobs) == 1 and None not in jobs and all(isinstance(k, int) and k > 0 for k in steps)
        self.batches: list[list[TrainSample]] = []
        if self.recorded:  # the job's own steps; inside one, groups in buffer order as its selection took them
            by_step: dict[int, list[Any]] = {}
            for x, k in zip(lines, steps, strict=True):
                by_step.setdefault(int(k), []).append(x)
            self.batches = [_grouped([exported_train_sample(x) for x in by_step[k]]) for k in sorted(by_step)]
        else:
            groups: dict[str, list[TrainSample]] = {}
            for x in lines:
                sample = exported_train_sample(x)
                groups.setdefault(sample.group_id or sample.sample_id or "", []).append(sample)
            current: list[TrainSample] = []
            for members in groups.values():
                if len(members) < group_size:
                    continue
                if len(current) + len(members) > batch_size:
                    if len(current) == batch_size:
                        self.batches.append(current)
                    current = []
                current += members
            if len(current) == batch_size:
                self.batches.append(current)
        if not self.batches:
            raise SourceError(f"{path}: no whole batch of {batch_size} rewarded samples in groups of {group_size}")

    def batch(self, step: int, version: int) -> Batch | None:
        if step >= len(self.batches):
            return None
        samples = self.batches[step]
        lags = [max(0, version - min((v for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m),
                                     default=version)) for s in samples]
        return Batch(samples=samples, lags=lags)


def _grouped(samples: list[TrainSample]) -> list[TrainSample]:
    """Members of a group together, groups in order of their first member (as ``selection.select`` takes them)."""
    groups: dict[str, list[TrainSample]] = {}
    for s in samples:
        groups.setdefault(s.group_id or s.sample_id or "", []).append(s)
    return [s for members in groups.values() for s in members]
