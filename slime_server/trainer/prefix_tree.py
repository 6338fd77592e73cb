"""Shared prefixes computed once: a micro-batch's samples laid out as a token tree (a trie) for the forward.

Why: the samples of a GRPO group answer the same prompt, and every sample of a job starts with the same
system prompt and tools; a packed row computes those tokens once per sample. The hidden state of a token
depends only on the tokens before it, so samples that share a prefix share its rows exactly: the forward
runs over the trie of the micro-batch's samples (each distinct prefix once, a token's position its depth,
each row attending to its ancestors and itself), and the rows are then indexed back into the samples'
own layout (``index``), where the log-probs, losses and metrics are taken as before. The gradient of a shared
row is the sum of its samples' gradients, which is what the separate rows would have added up to.

Measured on a recorded batch of the demo (32 calculator episodes, 4 prompts x 8 samples, 7.7k tokens, the
system prompt and tools shared by all, a prompt by each group, and most of the tool call by the samples that
make the same one): 889 tree rows, forward and backward 2.8 s -> 0.44 s on one core, the loss equal to 7
digits and every gradient to 1e-5 relative. ``tools/bench_trainer.py --prefixes`` times a synthetic batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slime_server.utils.sequences import common_prefix


@dataclass
class PrefixTree:
    """The forward's layout of one micro-batch: R rows, R <= the samples' total length T."""

    tokens: torch.Tensor  # long [R]: each distinct prefix's last token, parents before children
    position_ids: torch.Tensor  # long [R]: the row's depth = its position in every sample through it
    attention_mask: torch.Tensor  # bool [1, 1, R, R], True = masked out (Megatron's convention)
    index: torch.Tensor  # long [T]: the row of each token of the samples' concatenation

    @property
    def num_rows(self) -> int:
        return int(self.tokens.numel())

    def expand(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-row values (first dimension R) as per-token values of the samples' layout (first dimension T)."""
        return rows.index_select(0, self.index.to(rows.device))


def tree_rows(sequences: Sequence[Sequence[int]]) -> int:
    """Rows of the trie of ``sequences`` (in any order): what a shared-prefix forward computes."""
    ordered = sorted(list(s) for s in sequences)
    return sum(len(s) - (common_prefix(ordered[k - 1], s) if k else 0) for k, s in enumerate(ordered))


def build_tree(sequences: Sequence[Sequence[int]]) -> PrefixTree:
    """The trie of ``sequences`` in the given order; sorted order shares every common prefix (a sequence
    shares most with its neighbour in sorted order), another order shares prefixes with the previous one."""
    tokens: list[int] = []
    depth: list[int] = []
    index: list[int] = []
    segments: list[tuple[list[int], int, int]] = []  # (ancestor rows, first new row, end)
    prev: Sequence[int] = ()
    prev_path: list[int] = []
    for seq in sequences:
        shared = common_prefix(prev, seq)
        start = len(tokens)
        tokens.extend(seq[shared:])
        depth.extend(range(shared, len(seq)))
        path = prev_path[:shared] + list(range(start, len(tokens)))
        segments.append((prev_path[:shared], start, len(tokens)))
        index.extend(path)
        prev, prev_path = seq, path
    r = len(tokens)
    allowed = torch.zeros(r, r, dtype=torch.bool)
    for ancestors, a, b in segments:
        if b > a:
            allowed[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
            if ancestors:
                allowed[a:b, torch.tensor(ancestors, dtype=torch.long)] = True
    return PrefixTree(tokens=torch.tensor(tokens, dtype=torch.long), position_ids=torch.tensor(depth, dtype=torch.long),
                      attention_mask=(~allowed)[None, None], index=torch.tensor(index, dtype=torch.long))


def partition_sharing(sequences: Sequence[Sequence[int]], max_rows: int) -> list[list[int]]:
    """Indices of ``sequences`` in groups whose trie has at most ``max_rows`` rows (a longer sequence alone).

    Sorted order puts sequences with common prefixes side by side; consecutive runs are cut greedily, and the
    cap is then lowered as far as the same number of groups allows, so the groups come out even (the slowest
    micro-batch sets the step time). Each group lists its indices in sorted order (``build_tree``'s order)."""
    if max_rows <= 0:
        raise ValueError("max_rows must be positive")
    order = sorted(range(len(sequences)), key=lambda i: (list(sequences[i]), i))
    cost = [len(sequences[i]) - (common_prefix(sequences[order[k - 1]], sequences[i]) if k else 0)
            for k, i in enumerate(order)]
    full = [len(sequences[i]) for i in order]

    def cut(cap: int) -> list[list[int]]:
        groups: list[list[int]] = []
        load = 0
        for k, i in enumerate(order):
            if groups and load + cost[k] <= cap:
                groups[-1].append(i)
                load += cost[k]
            else:  # a group's first sequence shares with no one before it in the group
                groups.append([i])
                load = full[k]
        return groups

    best = cut(max_rows)
    lo, hi = 1, max_rows
    while lo < hi:  # the smallest cap giving no more groups than max_rows gives
        mid = (lo + hi) // 2
        if len(cut(mid)) <= len(best):
            hi = mid
        else:
            lo = mid + 1
    return cut(lo)
