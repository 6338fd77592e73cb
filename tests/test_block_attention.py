"""The trainer's core attention (trainer/block_attention.py) computes only the blocks a packed row's mask leaves
open, and gives Megatron's own DotProductAttention's output and gradients on every kind of mask the trainer makes:
packed samples, shared-prefix trees, padding; the masks it cannot cut go to Megatron's forward."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from slime_server.trainer.block_attention import BlockAttention, block_plan
from slime_server.trainer.model import build_attention_mask, build_gpt_model
from slime_server.trainer.parallel import parallel_context
from slime_server.trainer.prefix_tree import build_tree
from tests._megatron_helpers import make_config


@pytest.fixture(scope="module")
def attention() -> Iterator[BlockAttention]:
    with parallel_context(tp_size=1, seed=3):
        model = build_gpt_model(make_config("qwen3", num_key_value_heads=2))  # 4 query heads on 2 key/value heads
        core = model.decoder.layers[0].self_attention.core_attention
        yield core


def packed_mask(lengths: list[int]) -> torch.Tensor:
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return build_attention_mask(positions)


def tree_mask(seed: int, system: int = 0) -> torch.Tensor:
    """A micro-batch's shared-prefix tree: three prompts (opening with the same ``system`` tokens), each answered
    two to four times."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 50, (system,), generator=g).tolist()
    seqs = []
    for _ in range(3):
        prompt = head + torch.randint(0, 50, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
            seqs.append(prompt + torch.randint(50, 100, (int(torch.randint(1, 6, (1,), generator=g)),),
                                               generator=g).tolist())
    return build_tree(seqs).attention_mask


def padded_mask() -> torch.Tensor:
    lengths = [5, 7, 4, 6]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    padding = torch.ones_like(positions)
    padding[0, 3:5] = 0  # the first sample's last two tokens are padding: masked as keys, each sees itself
    padding[0, 16] = 0
    return build_attention_mask(positions, padding)


def run(core: BlockAttention, forward, mask: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    s = mask.shape[-1]
    g = torch.Generator().manual_seed(seed)
    heads, groups = core.num_attention_heads_per_partition, core.num_query_groups_per_partition
    dim = core.hidden_size_per_partition // heads
    q = torch.randn(s, 1, heads, dim, generator=g).requires_grad_()
    k = torch.randn(s, 1, groups, dim, generator=g).requires_grad_()
    v = torch.randn(s, 1, groups, dim, generator=g).requires_grad_()
    out = forward(core, q, k, v, mask)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("name", ["packed", "one long and short ones", "tree", "tree with a system prompt", "padding"])
def test_blocks_give_megatrons_attention_and_gradients(attention: BlockAttention, name: str) -> None:
    mask = {"packed": lambda: packed_mask([6, 9, 3, 12, 7, 5, 8, 4]),
            "one long and short ones": lambda: packed_mask([3, 20, 2, 4, 6, 9, 5]),
            "tree": lambda: tree_mask(5), "tree with a system prompt": lambda: tree_mask(6, system=4),
            "padding": padded_mask}[name]()
    plan = block_plan(mask)
    assert plan is not None  # cut into blocks, not Megatron's one matrix
    allowed = ~mask[0, 0]
    covered = torch.zeros_like(allowed)
    for a, b, keys in plan:
        covered[a:b, keys] = True
    assert bool((covered | ~allowed).all())  # every open key of every query is in its block
    assert covered.sum() < 0.5 * covered.numel()
    if name.startswith("tree"):  # an answer sees its prompt's rows and its own, not its siblings' between them
        assert any(isinstance(keys, torch.Tensor) for _, _, keys in plan)
    ours = run(attention, BlockAttention.forward, mask, seed=1)
    megatron = run(attention, DotProductAttention.forward, mask, seed=1)
    for x, y in zip(ours, megatron, strict=True):  # the same sums in another order: torch's float32 tolerances
        torch.testing.assert_close(x, y)


def test_packed_samples_are_blocks_of_their_own() -> None:
    assert block_plan(packed_mask([4, 6, 3])) == [(0, 4, slice(0, 4)), (4, 10, slice(4, 10)), (10, 13, slice(10, 13))]


def test_masks_it_cannot_cut_go_to_megatron(attention: BlockAttention) -> None:
    assert block_plan(packed_mask([20])) is None  # one sample: its causal half is Megatron's matmul's cost
    no_key = packed_mask([4, 4]).clone()
    no_key[0, 0, 5, :] = True  # a query with no open key: Megatron's softmax spreads it over the whole row
    assert block_plan(no_key) is None
    ours = run(attention, BlockAttention.forward, no_key, seed=2)
    megatron = run(attention, DotProductAttention.forward, no_key, seed=2)
    for x, y in zip(ours, megatron, strict=True):
        assert torch.equal(x, y)


def test_the_trainers_layers_use_it(attention: BlockAttention) -> None:
    assert type(attention) is BlockAttention
