"""Cut a global batch of samples into token-budgeted, packed micro-batches with exact loss weights.

A micro-batch is one row: the samples' tokens concatenated, position ids restarting at 0 for each
sample, and ``cu_seqlens`` marking the boundaries (varlen attention). Its per-token loss weights are
taken against the WHOLE batch passed in (not just the micro-batch or the ``subset`` packed here), so
the micro-batch losses of all micro-batches, on all data-parallel ranks, sum to the global loss.

With ``share_prefixes`` the budget counts the rows of the samples' token tree (``prefix_tree``): samples
with a common prefix (a GRPO group's prompt, a job's system prompt) share its rows in the forward, and the
micro-batch carries that layout in ``tree``; the per-token tensors stay in the samples' own layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_server.trainer.losses import loss_token_weights
from slime_server.trainer.prefix_tree import PrefixTree, build_tree, partition_sharing
from slime_server.trainer.settings import Aggregation
from slime_server.trainer.types import TrainSample


@dataclass
class MicroBatch:
    """One packed row of samples. All per-token tensors have shape [T] (T = sum of sample_lens)."""

    tokens: torch.Tensor  # long
    position_ids: torch.Tensor  # long, 0..len-1 per sample
    cu_seqlens: torch.Tensor  # int32 [n + 1]: sample k spans cu_seqlens[k]:cu_seqlens[k+1]
    sample_indices: list[int]  # positions of the samples in the batch given to pack_samples
    sample_lens: list[int]
    loss_mask: torch.Tensor  # float32 0./1., multiplies directly
    rollout_logprobs: torch.Tensor  # float32
    advantages: torch.Tensor  # float32; 0 where the sample has no advantages (e.g. SFT, scoring)
    # aggregation -> per-token weight against the global batch (see losses.loss_token_weights)
    token_weights: dict[Aggregation, torch.Tensor] = field(default_factory=dict)
    tree: PrefixTree | None = None  # the forward's layout when samples share prefixes (None: the row itself)
    # tokens sampled under a grammar: their rows in the packed row and their bitmasks (trainer/grammar_masks.py)
    grammar_rows: torch.Tensor | None = None  # long [K]
    grammar_bitmask: bytes | None = None  # K rows of int32 words
    # a multi-adapter LoRA trainer: the adapter of each forward row (long [R]; None: every row adapter 0)
    adapter_rows: torch.Tensor | None = None
    # MoE routing replay: each forward row's recorded top-k experts per layer (long [R, layers, k]; -1: none
    # recorded, the router chooses), None: no sample carries routes
    route_rows: torch.Tensor | None = None
    # a vision-language micro-batch: each sample's start in the packed row and its images (trainer/vision.py)
    images: list[tuple[int, list[Any]]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_rows(self) -> int:
        """Rows the forward computes (the token tree's when prefixes are shared)."""
        return self.tree.num_rows if self.tree is not None else self.num_tokens

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens [R], position ids [R], a ready attention mask [1, 1, R, R] or None to derive it)."""
        if self.tree is None:
            return self.tokens, self.position_ids, None
        return self.tree.tokens, self.tree.position_ids, self.tree.attention_mask

    def expand(self, rows: torch.Tensor) -> torch.Tensor:
        """The forward's per-row output [R, ...] in the samples' layout [T, ...]."""
        return rows if self.tree is None else self.tree.expand(rows)

    @property
    def max_seqlen(self) -> int:
        return max(self.sample_lens, default=0)


def _balanced_bins(lengths: Sequence[int], order: list[int], budget: int, n_bins: int) -> list[list[int]] | None:
    """Longest-first to the least-loaded of ``n_bins`` bins; None when a bin would overflow."""
    loads = [0] * n_bins
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in order:
        b = min(range(n_bins), key=lambda k: (loads[k], k))
        if bins[b] and loads[b] + lengths[i] > budget:
            return None
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def partition_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so each group's total length is <= ``max_tokens`` (a longer item is alone).

    First-fit decreasing fixes how many groups are needed; with that many, a longest-first
    least-loaded assignment evens the groups out when it fits (it usually does), because the
    slowest micro-batch sets the step time. Groups keep ascending index order.
    """
    if max_tokens <= 0:
        raise ValueError("max_tokens must be positive")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ffd: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                ffd[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            ffd.append([i])
            loads.append(lengths[i])
    bins = _balanced_bins(lengths, order, max_tokens, len(ffd)) if ffd else []
    chosen = bins if bins is not None else ffd
    return sorted((sorted(b) for b in chosen), key=lambda b: b[0])


def _pack(samples: Sequence[TrainSample], idx: list[int], weights: dict[Aggregation, list[torch.Tensor]]) -> MicroBatch:
    # by adapter (stable): each adapter's rows one block in a multi-adapter trainer's forward (lora.py)
    idx = sorted(idx, key=lambda i: samples[i].adapter)
    picked = [samples[i] for i in idx]
    lens = [len(s.tokens) for s in picked]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return MicroBatch(
        tokens=torch.tensor([t for s in picked for t in s.tokens], dtype=torch.long),
        position_ids=torch.cat([torch.arange(n, dtype=torch.long) for n in lens]),
        cu_seqlens=cu, sample_indices=list(idx), sample_lens=lens,
        loss_mask=torch.tensor([m for s in picked for m in s.loss_mask], dtype=torch.float32),
        rollout_logprobs=torch.tensor([x for s in picked for x in s.rollout_logprobs], dtype=torch.float32),
        advantages=torch.tensor([a for s in picked for a in (s.advantages or [0.0] * len(s.tokens))],
                                dtype=torch.float32),
        token_weights={agg: torch.cat([w[i] for i in idx]).to(torch.float32) for agg, w in weights.items()},
        adapter_rows=torch.tensor([s.adapter for s in picked for _ in s.tokens], dtype=torch.long)
        if any(s.adapter for s in picked) else None,
        route_rows=_routes(picked, lens),
        images=[(start, s.images) for s, start in zip(picked, cu[:-1].tolist(), strict=True)]
        if any(s.images for s in picked) else None,
        **_grammar(picked, lens),
    )


def _routes(picked: list[TrainSample], lens: list[int]) -> torch.Tensor | None:
    """The packed row's recorded routes [T, layers, k]: each sample's, -1 past them (its last token, or a sample
    recorded without routes)."""
    found = [s.routed_experts for s in picked if s.routed_experts is not None]
    if not found:
        return None
    layers, topk = found[0].layers, found[0].topk
    rows = torch.full((sum(lens), layers, topk), -1, dtype=torch.long)
    offset = 0
    for s, n in zip(picked, lens, strict=True):
        r = s.routed_experts
        if r is not None:
            if (r.layers, r.topk) != (layers, topk):
                raise ValueError(f"samples carry routes of [{r.layers}, {r.topk}] and [{layers}, {topk}]")
            held = torch.from_numpy(r.array()[:n])
            rows[offset:offset + len(held)] = held
        offset += n
    return rows


def _grammar(picked: list[TrainSample], lens: list[int]) -> dict[str, Any]:
    """The micro-batch's grammar positions (offset into the packed row) and their bitmasks, in order."""
    rows: list[int] = []
    masks: list[bytes] = []
    offset = 0
    for s, n in zip(picked, lens, strict=True):
        if s.grammar_positions:
            rows += [offset + p for p in s.grammar_positions]
            masks.append(s.grammar_bitmask or b"")
        offset += n
    if not rows:
        return {}
    return {"grammar_rows": torch.tensor(rows, dtype=torch.long), "grammar_bitmask": b"".join(masks)}


def global_token_weights(samples: Sequence[TrainSample]) -> dict[Aggregation, list[torch.Tensor]]:
    """Per-sample, per-token loss weights against the whole ``samples`` batch, for both aggregations."""
    total_tokens = sum(s.num_loss_tokens for s in samples)
    out: dict[Aggregation, list[torch.Tensor]] = {"token": [], "sequence": []}
    for s in samples:
        mask = torch.tensor(s.loss_mask, dtype=torch.float64)
        out["token"].append(loss_token_weights(mask, [len(s.tokens)], "token", global_tokens=total_tokens))
        out["sequence"].append(loss_token_weights(mask, [len(s.tokens)], "sequence", global_samples=len(samples)))
    return out


def pack_samples(
    samples: Sequence[TrainSample], max_tokens_per_micro_batch: int, *, subset: Sequence[int] | None = None,
    share_prefixes: bool = False,
) -> list[MicroBatch]:
    """Packed micro-batches of ``samples[subset]`` (default: all), each <= the token budget.

    Loss weights are normalised over ALL ``samples`` (the global batch), so pass the global batch
    and this rank's ``subset`` under data parallelism. ``sample_indices`` index into ``samples``.
    With ``share_prefixes`` the budget is on the forward's rows (each shared prefix once); where no
    two samples share a token the packing is the plain one.
    """
    chosen = list(range(len(samples))) if subset is None else list(subset)
    if any(not 0 <= i < len(samples) for i in chosen) or len(set(chosen)) != len(chosen):
        raise ValueError("subset must hold distinct indices into samples")
    weights = global_token_weights(samples)
    if share_prefixes and len({samples[i].tokens[0] for i in chosen}) < len(chosen):
        # a prefix is shared only where every position of it is the same token, under the same adapter (its hidden
        # states differ under another), routed to the same experts (MoE routing replay: a prefix the engine
        # computed again after a weight update may carry other routes) and, at an image's pads, showing the same
        # image there (the pads are one token id whatever the image); the trie is built over one key per distinct
        # (routes, adapter, token, image position) and each row's token and adapter read back from its key
        keyed, table = _trie_keys(samples, chosen)
        groups = partition_sharing([keyed[i] for i in chosen], max_tokens_per_micro_batch)
        mbs = [_pack(samples, [chosen[j] for j in g], weights) for g in groups]
        for mb in mbs:
            tree = build_tree([keyed[i] for i in mb.sample_indices])
            if tree.num_rows < mb.num_tokens:
                keys = tree.tokens
                tree.tokens = table[keys, 1]
                mb.tree = tree
                mb.adapter_rows = table[keys, 0] if mb.adapter_rows is not None else None
                if mb.route_rows is not None:  # the forward's rows: every token of a row carries the row's routes
                    rows = mb.route_rows.new_full((tree.num_rows, *mb.route_rows.shape[1:]), -1)
                    rows[tree.index] = mb.route_rows
                    mb.route_rows = rows
        return mbs
    groups = partition_by_tokens([len(samples[i].tokens) for i in chosen], max_tokens_per_micro_batch)
    return [_pack(samples, [chosen[j] for j in g], weights) for g in groups]


def _trie_keys(samples: Sequence[TrainSample], chosen: Sequence[int]) -> tuple[dict[int, list[int]], torch.Tensor]:
    """Each chosen sample's positions as trie keys, one per distinct (routes, adapter, token, image position)
    (routes: the position's recorded expert ids, or none; image position: which image's which pad, or none), and
    the table [keys, 2] of each key's (adapter, token)."""
    ids: dict[tuple[int, int, int, int], int] = {}
    routes: dict[bytes, int] = {}
    pads: dict[tuple[str, int], int] = {}
    keyed: dict[int, list[int]] = {}
    for i in chosen:
        s = samples[i]
        held = s.routed_experts.array() if s.routed_experts is not None else None
        n_held = 0 if held is None else min(len(held), len(s.tokens))
        shown = {im.offset + j: pads.setdefault((im.sha256, j), len(pads) + 1)
                 for im in s.images for j in range(im.length)}
        seq = []
        for t, token in enumerate(s.tokens):
            route = routes.setdefault(held[t].tobytes(), len(routes) + 1) if held is not None and t < n_held else 0
            seq.append(ids.setdefault((route, s.adapter, token, shown.get(t, 0)), len(ids)))
        keyed[i] = seq
    table = torch.tensor([(adapter, token) for _, adapter, token, _ in ids], dtype=torch.long).reshape(-1, 2)
    return keyed, table


def split_packed(flat: torch.Tensor, sample_lens: Sequence[int]) -> list[torch.Tensor]:
    """Per-sample pieces of a packed per-token tensor (views; first dimension is the token axis)."""
    if flat.shape[0] != sum(sample_lens):
        raise ValueError(f"tensor has {flat.shape[0]} tokens but sample_lens sum to {sum(sample_lens)}")
    return list(flat.split(list(sample_lens)))


def split_by_count(n_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive index groups of at most ``micro_batch_size`` samples (the unpacked path)."""
    if micro_batch_size <= 0:
        raise ValueError("micro_batch_size must be positive")
    return [list(range(i, min(i + micro_batch_size, n_samples))) for i in range(0, n_samples, micro_batch_size)]
