"""Packing: coverage, budgets, balance, and exact global-loss reconstruction from micro-batches."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_server.trainer.losses import policy_loss
from slime_server.trainer.packing import pack_samples, partition_by_tokens, split_by_count, split_packed
from slime_server.trainer.settings import LossConfig
from slime_server.trainer.types import TrainSample


def _batch(lengths: list[int], seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = rng.randint(1, max(1, n - 1)) if n > 1 else 1
        mask = [0] * prompt + [1] * (n - prompt)
        out.append(TrainSample(
            tokens=[rng.randrange(1000) for _ in range(n)], loss_mask=mask,
            rollout_logprobs=[-rng.uniform(0.5, 3.0) if m else 0.0 for m in mask], reward=0.0,
            group_id=f"g{i // 2}", weight_versions=[0 if m else -1 for m in mask],
            advantages=[rng.uniform(-2, 2) if m else 0.0 for m in mask], sample_id=f"s{i}",
        ))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 64))
def test_every_token_once_and_budget_respected(lengths: list[int], budget: int) -> None:
    samples = _batch(lengths)
    mbs = pack_samples(samples, budget)
    assert sorted(i for mb in mbs for i in mb.sample_indices) == list(range(len(samples)))
    for mb in mbs:
        assert mb.num_tokens <= budget or len(mb.sample_indices) == 1  # oversize samples ride alone
        for i, tok, pos in zip(mb.sample_indices, split_packed(mb.tokens, mb.sample_lens),
                               split_packed(mb.position_ids, mb.sample_lens), strict=True):
            assert tok.tolist() == samples[i].tokens
            assert pos.tolist() == list(range(len(samples[i].tokens)))
        assert mb.cu_seqlens.tolist() == [0, *torch.tensor(mb.sample_lens).cumsum(0).tolist()]


def test_partition_is_balanced_by_hand() -> None:
    # lengths 4 3 3 2, budget 10: first-fit decreasing needs 2 bins ({4,3,3}=10, {2}); the balanced
    # assignment with 2 bins puts 4 -> A, 3 -> B, 3 -> B (6), 2 -> A (6).
    assert partition_by_tokens([4, 3, 3, 2], 10) == [[0, 3], [1, 2]]
    # 12 > budget: alone; 5 + 4 fit one bin.
    assert partition_by_tokens([5, 12, 4], 10) == [[0, 2], [1]]
    with pytest.raises(ValueError):
        partition_by_tokens([1], 0)


def test_split_by_count() -> None:
    assert split_by_count(5, 2) == [[0, 1], [2, 3], [4]]
    assert split_by_count(0, 3) == []


def _micro_batch_losses(cfg: LossConfig, samples: list[TrainSample], budget: int, subset: list[int] | None,
                        logprobs: list[torch.Tensor], old: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for mb in pack_samples(samples, budget, subset=subset):
        lp = torch.cat([logprobs[i] for i in mb.sample_indices])
        loss, _ = policy_loss(cfg, lp, torch.cat([old[i] for i in mb.sample_indices]), mb.rollout_logprobs,
                              mb.advantages, mb.loss_mask, mb.sample_lens, token_weights=mb.token_weights)
        total = total + loss
    return total


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_micro_batch_losses_sum_to_the_global_loss(aggregation: str, loss_type: str) -> None:
    samples = _batch([7, 19, 3, 12, 25, 5, 9], seed=3)
    gen = torch.Generator().manual_seed(1)
    old = [torch.tensor(s.rollout_logprobs, dtype=torch.float64) for s in samples]
    cur = [(o + 0.3 * torch.randn(len(o), generator=gen, dtype=torch.float64)) * torch.tensor(s.loss_mask)
           for o, s in zip(old, samples, strict=True)]
    cfg = LossConfig(loss_type=loss_type, aggregation=aggregation, use_tis=True, tis_clip=1.5)

    def global_loss(leaves: list[torch.Tensor]) -> torch.Tensor:
        """The unpacked reference: the whole batch as one call, normalised over itself."""
        def cat(xs: list) -> torch.Tensor:
            return torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in xs])

        loss, _ = policy_loss(cfg, cat(leaves), cat(old), cat([s.rollout_logprobs for s in samples]),
                              cat([s.advantages for s in samples]), cat([s.loss_mask for s in samples]),
                              [len(s.tokens) for s in samples])
        return loss

    ref_leaves = [c.clone().requires_grad_(True) for c in cur]
    reference = global_loss(ref_leaves)
    reference.backward()
    for budget in (1, 20, 40, 1000):
        leaves = [c.clone().requires_grad_(True) for c in cur]
        total = _micro_batch_losses(cfg, samples, budget, None, leaves, old)
        assert total.item() == pytest.approx(reference.item(), abs=1e-6, rel=0), budget
        total.backward()
        for a, b in zip(leaves, ref_leaves, strict=True):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)
    # two data-parallel ranks each packing their subset against the same global batch
    leaves = [c.clone().requires_grad_(True) for c in cur]
    halves = [_micro_batch_losses(cfg, samples, 30, sub, leaves, old) for sub in ([0, 2, 4, 6], [1, 3, 5])]
    assert (halves[0] + halves[1]).item() == pytest.approx(reference.item(), abs=1e-6, rel=0)


def test_global_weights_by_hand() -> None:
    # masked tokens: sample 0 has 2, sample 1 has 3 (5 in all, 2 samples).
    # token weights 1/5 each; sequence weights 1/(2*2) = 0.25 and 1/(3*2) = 1/6
    samples = [TrainSample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0.0] * 3,
                           weight_versions=[-1, 0, 0]),
               TrainSample(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], rollout_logprobs=[0.0] * 4,
                           weight_versions=[-1, 0, 0, 0])]
    (only_second,) = pack_samples(samples, 100, subset=[1])
    assert only_second.sample_indices == [1]
    assert only_second.token_weights["token"].tolist() == pytest.approx([0, 0.2, 0.2, 0.2])
    assert only_second.token_weights["sequence"].tolist() == pytest.approx([0, 1 / 6, 1 / 6, 1 / 6])
    assert only_second.advantages.tolist() == [0.0] * 4  # no advantages yet (e.g. scoring only)
    with pytest.raises(ValueError, match="subset"):
        pack_samples(samples, 100, subset=[0, 0])


def _sharing_batch(seed: int, n: int) -> list[TrainSample]:
    """Samples built from a few common stems (so prefixes are shared at several depths), some duplicated."""
    rng = random.Random(seed)
    stems = [[rng.randrange(6) for _ in range(rng.randint(1, 8))] for _ in range(3)]
    out = []
    for i in range(n):
        tokens = list(rng.choice(stems)) + [rng.randrange(6) for _ in range(rng.randint(1, 10))]
        if i and rng.random() < 0.2:
            tokens = list(out[-1].tokens)
        mask = [0] + [rng.randint(0, 1) for _ in tokens[1:]]
        out.append(TrainSample(tokens=tokens, loss_mask=mask, rollout_logprobs=[-1.0 * m for m in mask],
                               weight_versions=[0 if m else -1 for m in mask], advantages=[1.0 * m for m in mask]))
    return out


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 14), st.integers(1, 60))
def test_shared_prefix_layout_is_each_samples_causal_row(seed: int, n: int, budget: int) -> None:
    """Every sample once; a micro-batch's tree has at most the budget's rows (or one sample); expanded, the
    tree's tokens and positions are each sample's own; a row attends exactly to the rows of its own prefix."""
    from slime_server.trainer.prefix_tree import tree_rows

    samples = _sharing_batch(seed, n)
    mbs = pack_samples(samples, budget, share_prefixes=True)
    assert sorted(i for mb in mbs for i in mb.sample_indices) == list(range(n))
    for mb in mbs:
        seqs = [samples[i].tokens for i in mb.sample_indices]
        assert mb.num_rows == (tree_rows(seqs) if mb.tree is not None else mb.num_tokens)
        assert mb.num_rows <= budget or len(mb.sample_indices) == 1
        assert mb.tokens.tolist() == [t for s in seqs for t in s]
        tokens, positions, mask = mb.model_inputs()
        assert mb.expand(tokens).tolist() == mb.tokens.tolist()
        assert mb.expand(positions).tolist() == mb.position_ids.tolist()
        if mb.tree is None:
            assert mask is None
            continue
        rows_of = split_packed(mb.tree.index, mb.sample_lens)
        allowed = ~mask[0, 0]
        for r in range(mb.num_rows):  # the rows a row may see: those before it on any sample's path through it
            seen = {int(x) for path in rows_of for k, x in enumerate(path) if r in path[k:].tolist()}
            assert set(torch.nonzero(allowed[r]).flatten().tolist()) == seen


def test_share_prefixes_keeps_the_plain_packing_when_nothing_is_shared() -> None:
    samples = _batch([5, 7, 3, 9], seed=3)
    samples = [s.model_copy(update={"tokens": [1000 + i] + s.tokens[1:]}) for i, s in enumerate(samples)]
    plain = pack_samples(samples, 12)
    shared = pack_samples(samples, 12, share_prefixes=True)
    assert [mb.sample_indices for mb in shared] == [mb.sample_indices for mb in plain]
    assert all(mb.tree is None for mb in shared)
