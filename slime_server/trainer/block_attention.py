"""Core attention that computes only the blocks a packed row's mask leaves open.

Why: the trainer packs a micro-batch's samples into one row of up to ``max_tokens_per_micro_batch`` tokens, each
sample attending only to itself, or, with shared prefixes (``prefix_tree.py``), each node of the token tree to its
ancestors and itself. Megatron's local ``DotProductAttention`` computes every query against every key of the row
and masks all but those afterwards: for 32 samples of ~100 tokens, 32 times the work (and the memory of a
[heads, T, T] score matrix) the mask keeps. This subclass cuts the row into runs of queries where each query sees
what the one before it saw and itself (one sample, or one node of the tree), and scores each run against only the
keys its last query sees (a slice when they are contiguous, else gathered), with Megatron's own scale, mask and
softmax on the block: every key it skips was masked out for every query of the run, so the result is Megatron's up
to the order of a floating-point sum. Anything else (a batch of several rows, a row with no open key, attention
dropout while training, a learnable softmax offset, packed-sequence parameters, or blocks that would cover most of
the row anyway) goes to Megatron's own forward.

The plan is made once per mask: every layer of a forward gets the same mask tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

# blocks covering at least this share of the whole [T, T] score matrix: Megatron's one matmul is as cheap
DENSE_SHARE = 0.5

Keys = slice | torch.Tensor  # a block's keys: contiguous, or the indices of those its queries see
Plan = list[tuple[int, int, Keys]]  # (first query, end query, keys) per block
_last: tuple[weakref.ref[torch.Tensor], int, Plan | None] | None = None


def block_plan(mask: torch.Tensor) -> Plan | None:
    """The blocks of a [1, 1, S, S] self-attention mask (True = masked out): runs of queries each seeing what the
    query before it saw and itself, with the keys the run's last query sees. None when a query sees no key
    (Megatron's softmax then spreads it over every key of the row) or the blocks cover ``DENSE_SHARE`` of the matrix."""
    allowed = ~mask[0, 0]
    sq, sk = allowed.shape
    if sq == 0 or sq != sk or not bool(allowed.any(dim=-1).all()):
        return None
    r = torch.arange(sq - 1, device=allowed.device)
    grew = allowed[1:] ^ allowed[:-1]  # what each query sees that the one before it did not, or no longer sees
    extends = (grew.sum(dim=-1) == 1) & grew[r, r + 1] & allowed[r + 1, r + 1]
    bounds = [0, *(torch.nonzero(~extends).flatten() + 1).tolist(), sq]
    plan: Plan = []
    cost = 0
    for a, b in zip(bounds, bounds[1:], strict=False):
        keys = torch.nonzero(allowed[b - 1]).flatten()
        k0, k1 = int(keys[0]), int(keys[-1]) + 1
        plan.append((a, b, slice(k0, k1) if k1 - k0 == keys.numel() else keys))
        cost += (b - a) * keys.numel()
    return None if cost >= DENSE_SHARE * sq * sk else plan


def _plan_for(mask: torch.Tensor) -> Plan | None:
    """``block_plan`` of this mask, computed once while the same tensor comes back (one per layer of a forward)."""
    global _last
    if _last is not None and _last[0]() is mask and _last[1] == mask._version:
        return _last[2]
    plan = block_plan(mask)
    _last = (weakref.ref(mask), mask._version, plan)
    return plan


class BlockAttention(DotProductAttention):
    """Megatron's local core attention, computed block by block on a packed row (module docstring)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        plan = None
        if (packed_seq_params is None and attention_bias is None and self.softmax_offset is None
                and query.size(1) == 1 and attention_mask is not None and attention_mask.dim() == 4
                and tuple(attention_mask.shape[:2]) == (1, 1)
                and tuple(attention_mask.shape[2:]) == (query.size(0), key.size(0))
                and not (self.training and self.attention_dropout.p > 0)):
            plan = _plan_for(attention_mask)
        if plan is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (t[:, 0].transpose(0, 1) for t in (query, key, value))  # [heads, S, head dim]
        blocks = []
        for a, b, keys in plan:
            kb, vb = k[:, keys], v[:, keys]  # a view of a slice, a copy of gathered keys
            scores = torch.baddbmm(q.new_empty(q.size(0), b - a, kb.size(1)), q[:, a:b], kb.transpose(1, 2),
                                   beta=0.0, alpha=self.softmax_scale)
            probs = self.scale_mask_softmax(scores[None], attention_mask[:, :, a:b, keys], self.softmax_offset)
            blocks.append(torch.bmm(probs[0], vb))
        context = torch.cat(blocks, dim=1)  # [heads, Sq, head dim]
        return context.transpose(0, 1).reshape(query.size(0), 1, self.hidden_size_per_partition)
