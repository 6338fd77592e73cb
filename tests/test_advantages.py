"""Advantage estimators against numbers worked out by hand (in the comments)."""

from __future__ import annotations

import math

import pytest

from slime_server.trainer.advantages import (
    AdvantageConfig,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    opd_advantages,
    per_adapter,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    token_rewards,
)
from slime_server.trainer.types import TrainSample


def _s(mask: list[int], reward: float, group: str | None = None, **kw: object) -> TrainSample:
    n = len(mask)
    return TrainSample(tokens=list(range(n)), loss_mask=mask, rollout_logprobs=[0.0] * n, reward=reward,
                       group_id=group, weight_versions=[0 if m else -1 for m in mask], **kw)


def test_grpo_group_normalisation_by_hand() -> None:
    # group g: rewards 3, 1, 2 -> mean 2, unbiased std sqrt((1 + 1 + 0) / 2) = 1 -> A = +-1 / (1 + 1e-6), 0
    # group h: rewards 2, 2 -> std 0 -> A = 0;   no group: alone -> A = 0
    samples = [_s([0, 1, 1, 0, 1], 3.0, "g"), _s([0, 1], 1.0, "g"), _s([0, 1], 2.0, "g"),
               _s([0, 1], 2.0, "h"), _s([0, 1], 2.0, "h"), _s([0, 1], 5.0)]
    out = grpo_advantages(samples)
    a = 1 / (1 + 1e-6)
    assert out[0].advantages == pytest.approx([0.0, a, a, 0.0, a], abs=1e-12)
    assert out[1].advantages == pytest.approx([0.0, -a], abs=1e-12)
    assert [o.advantages for o in out[2:]] == [[0.0, 0.0]] * 4
    assert samples[0].advantages is None  # inputs untouched


def test_grpo_std_of_binary_rewards_and_dr_grpo() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503 -> A = +-0.5 / (0.5773503 + 1e-6)
    samples = [_s([0, 1], r, "g") for r in (1.0, 0.0, 0.0, 1.0)]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [o.advantages[1] for o in grpo_advantages(samples)] == pytest.approx([a, -a, -a, a], abs=1e-12)
    # Dr.GRPO: no std -> +-0.5
    assert [o.advantages[1] for o in dr_grpo_advantages(samples)] == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_reinforce_plus_plus_whitens_over_the_batch() -> None:
    # gamma 1, no KL: returns on masked tokens: sample 1 -> 1, 1; sample 2 -> -1.
    # batch mean 1/3, var ((2/3)^2 * 2 + (4/3)^2) / 3 = 8/9 -> std 0.9428090
    # A = (1 - 1/3) / 0.9428090 = 0.7071068, (-1 - 1/3) / 0.9428090 = -1.4142136
    out = reinforce_plus_plus_advantages([_s([0, 1, 1], 1.0), _s([0, 1], -1.0)])
    assert out[0].advantages == pytest.approx([0.0, 0.7071068, 0.7071068], abs=1e-6)
    assert out[1].advantages == pytest.approx([0.0, -1.4142136], abs=1e-6)


def test_kl_shaped_token_rewards_and_discounted_returns() -> None:
    # kl_coef 0.5, kl 0.2 / 0.4 on the masked tokens, reward 1 on the last: rewards 0, -0.1, -0.2 + 1 = 0.8
    # gamma 0.5: G_2 = 0.8, G_1 = -0.1 + 0.5 * 0.8 = 0.3
    s = _s([0, 1, 1], 1.0)
    rewards = token_rewards(s, kl=[9.0, 0.2, 0.4], kl_coef=0.5)
    assert rewards == pytest.approx([0.0, -0.1, 0.8])
    assert discounted_returns(rewards, s.loss_mask, 0.5) == pytest.approx([0.0, 0.3, 0.8])
    # an unmasked tool-result token between two generated ones is not a step: G_1 = 0.5 * 1
    assert discounted_returns([0.0, 0.0, 0.0, 1.0], [0, 1, 0, 1], 0.5) == [0.0, 0.5, 0.0, 1.0]


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    # group rewards 1, 0 -> centred +0.5, -0.5 -> token values 0.5, 0.5, -0.5
    # batch std: mean 1/6, var = mean(x^2) - mean^2 = 0.25 - 1/36 = 2/9 -> std 0.4714045
    # A = +-0.5 / 0.4714045 = +-1.0606602 (not re-centred)
    out = reinforce_plus_plus_baseline_advantages([_s([0, 1, 1], 1.0, "g"), _s([0, 1], 0.0, "g")])
    assert out[0].advantages == pytest.approx([0.0, 1.0606602, 1.0606602], abs=1e-6)
    assert out[1].advantages == pytest.approx([0.0, -1.0606602], abs=1e-6)


def test_gae_by_hand() -> None:
    # mask 0 1 1 1, reward 1, V = ., 0.5, 0.6, 0.8, gamma 1, lambda 0.5:
    # t3: delta = 1 + 0 - 0.8 = 0.2, A = 0.2, R = 1.0
    # t2: delta = 0.8 - 0.6 = 0.2,   A = 0.2 + 0.5 * 0.2 = 0.3,  R = 0.9
    # t1: delta = 0.6 - 0.5 = 0.1,   A = 0.1 + 0.5 * 0.3 = 0.25, R = 0.75
    (out,) = gae_advantages([_s([0, 1, 1, 1], 1.0)], [[7.0, 0.5, 0.6, 0.8]], gamma=1.0, lam=0.5)
    assert out.advantages == pytest.approx([0.0, 0.25, 0.3, 0.2])
    assert out.returns == pytest.approx([0.0, 0.75, 0.9, 1.0])
    with pytest.raises(ValueError, match="values"):
        gae_advantages([_s([0, 1], 1.0)], [[0.0]])


def test_opd_mixes_rl_and_teacher_terms() -> None:
    # w_rl 0.5, w_opd 2: t1: 0.5 * 1 + 2 * (-1 - -1.5) = 1.5; t2: 0.5 * 1 + 2 * (-2 - -1) = -1.5
    s = TrainSample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0.0, -1.5, -1.0], reward=1.0,
                    weight_versions=[-1, 0, 0], advantages=[0.0, 1.0, 1.0], teacher_logprobs=[0.0, -1.0, -2.0])
    (out,) = opd_advantages([s], w_rl=0.5, w_opd=2.0)
    assert out.advantages == pytest.approx([0.0, 1.5, -1.5])
    with pytest.raises(ValueError, match="teacher_logprobs"):
        opd_advantages([_s([0, 1], 1.0)])


def test_dispatch_matches_estimators() -> None:
    samples = [_s([0, 1, 1], 1.0, "g"), _s([0, 1], 0.0, "g")]
    assert compute_advantages(samples, AdvantageConfig(estimator="gspo")) == grpo_advantages(samples)
    assert compute_advantages(samples, AdvantageConfig(estimator="reinforce_plus_plus_baseline")) == \
        reinforce_plus_plus_baseline_advantages(samples)


def test_train_sample_rejects_misaligned_input() -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="rollout_logprobs"):
        TrainSample(tokens=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0], weight_versions=[-1, 0])
    with pytest.raises(pydantic.ValidationError, match="loss_mask\\[0\\]"):
        TrainSample(tokens=[1, 2], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0], weight_versions=[0, 0])


def test_dapo_overlong_penalty_by_hand() -> None:
    from slime_server.trainer.advantages import AdvantageConfig, compute_advantages, overlong_penalty

    # max 10, cache 4: up to 6 tokens free; 8 tokens -> (6 - 8) / 4 = -0.5; 10 -> -1.0; 11 -> -1
    assert [overlong_penalty(n, 10, 4) for n in (3, 6, 7, 8, 10, 11)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    samples = [TrainSample(tokens=list(range(2 + n)), loss_mask=[0, 0] + [1] * n, rollout_logprobs=[0.0] * (2 + n),
                           reward=1.0, group_id="g", weight_versions=[-1, -1] + [0] * n) for n in (4, 8)]
    out = compute_advantages(samples, AdvantageConfig(estimator="dr_grpo", overlong_max_len=10, overlong_cache_len=4))
    # shaped rewards 1.0 and 0.5; Dr.GRPO: minus the group mean 0.75 -> +0.25 and -0.25 on the masked tokens
    assert [a for a, m in zip(out[0].advantages, out[0].loss_mask, strict=True) if m] == [0.25] * 4
    assert [a for a, m in zip(out[1].advantages, out[1].loss_mask, strict=True) if m] == [-0.25] * 8
    with pytest.raises(ValueError):
        AdvantageConfig(overlong_max_len=4, overlong_cache_len=4)


def test_each_adapters_advantages_are_centred_on_its_own_rewards() -> None:
    # adapter 0 (a user doing well): rewards 1, 1, 1, -1; adapter 1 (doing better still): 1, 1, 1, 1.
    # Batch-wide REINFORCE++: mean 0.75 -> adapter 0's advantages sum to 3 * 0.25 - 1.75 = -1 (over its std):
    # negative on the whole. Per adapter: adapter 0's mean 0.5, std sqrt(0.75) -> +-0.5 / 0.8660254 summing to 0;
    # adapter 1's rewards are all equal -> 0 (no signal).
    rewards = [(0, 1.0), (1, 1.0), (0, 1.0), (1, 1.0), (0, 1.0), (1, 1.0), (0, -1.0), (1, 1.0)]
    samples = [_s([0, 1], r, adapter=a) for a, r in rewards]
    whole = reinforce_plus_plus_advantages(samples)
    assert sum(o.advantages[1] for o, (a, _) in zip(whole, rewards, strict=True) if a == 0) < -0.5
    out = per_adapter(samples, lambda part, kl, values: reinforce_plus_plus_advantages(part))
    assert [o.adapter for o in out] == [a for a, _ in rewards]  # the input's order
    a = 0.5 / math.sqrt(0.75 + 1e-8)
    assert [o.advantages[1] for o in out] == pytest.approx([a, 0.0, a, 0.0, a, 0.0, -3 * a, 0.0], abs=1e-6)
    # one adapter: the batch-wide estimate itself, kl and values passed through in order
    seen: list[object] = []
    one = per_adapter(samples[0:4:2], lambda part, kl, values: seen.extend([kl, values]) or part, kl=[[0.1], [0.2]],
                      values=[[1.0], [2.0]])
    assert one == samples[0:4:2] and seen == [[[0.1], [0.2]], [[1.0], [2.0]]]
    split: list[object] = []
    per_adapter(samples[:4], lambda part, kl, values: split.append((kl, values)) or part, kl=[[0], [1], [2], [3]],
                values=[[4], [5], [6], [7]])
    assert split == [([[0], [2]], [[4], [6]]), ([[1], [3]], [[5], [7]])]
