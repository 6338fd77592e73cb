"""Policy / value losses against numbers worked out by hand (in the comments)."""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from slime_server.trainer.losses import kl_penalty, loss_token_weights, policy_loss, value_loss
from slime_server.trainer.settings import LossConfig


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _call(cfg: LossConfig, logprobs: list[float], advantages: list[float], mask: list[int], lens: list[int],
          old: list[float] | None = None, rollout: list[float] | None = None, **kw: torch.Tensor):
    lp = _t(logprobs).requires_grad_(True)
    old_t = _t(old) if old is not None else torch.zeros_like(lp)
    loss, metrics = policy_loss(cfg, lp, old_t, _t(rollout) if rollout is not None else old_t.clone(),
                                _t(advantages), _t(mask), lens, **kw)
    return lp, loss, metrics


# One sample, position 0 unmasked; old log-probs 0, so ratio_t = exp(logprob_t).
RATIOS = [1.0, 1.5, 0.5, 1.1, 0.7]
ADVS = [0.0, 1.0, 1.0, -1.0, -1.0]
MASK = [0, 1, 1, 1, 1]


def test_ppo_clip_by_hand() -> None:
    # eps 0.2, loss_t = max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5 A=+1: max(-1.5, -1.2) = -1.2 (clipped)   r=0.5 A=+1: max(-0.5, -0.8) = -0.5
    #   r=1.1 A=-1: max(1.1, 1.1)   = 1.1              r=0.7 A=-1: max(0.7, 0.8)   = 0.8 (clipped)
    # token mean = (-1.2 - 0.5 + 1.1 + 0.8) / 4 = 0.05; clip fraction 2/4; ratio mean 3.8/4 = 0.95
    # d loss / d logp_t = -A r / 4 where unclipped: t2 -> -0.125, t3 -> +0.275; 0 where clipped.
    lp, loss, m = _call(LossConfig(loss_type="ppo"), [math.log(r) for r in RATIOS], ADVS, MASK, [5])
    assert loss.item() == pytest.approx(0.05, abs=1e-12)
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(0.95)
    assert m["ratio_max"].item() == pytest.approx(1.5) and m["ratio_min"].item() == pytest.approx(0.5)
    assert m["pg_loss"].item() == pytest.approx(0.05)
    loss.backward()
    torch.testing.assert_close(lp.grad, _t([0.0, 0.0, -0.125, 0.275, 0.0]))


def test_asymmetric_clip_higher() -> None:
    # eps_clip_high 0.28: r=1.5 A=+1 now gives max(-1.5, -1.28) = -1.28; the rest as above.
    # (-1.28 - 0.5 + 1.1 + 0.8) / 4 = 0.03
    _, loss, m = _call(LossConfig(loss_type="grpo", eps_clip_high=0.28), [math.log(r) for r in RATIOS],
                       ADVS, MASK, [5])
    assert loss.item() == pytest.approx(0.03, abs=1e-12)
    assert m["clip_fraction"].item() == pytest.approx(0.5)


def test_dual_clip_only_for_negative_advantages() -> None:
    # c = 3, eps 0.2:
    #   r=5 A=-1: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual clip)
    #   r=5 A=+1: max(-5, -1.2) = -1.2; dual clip must NOT apply (it would give min(-1.2, -3) = -3)
    #   r=2 A=-1: max(2, 1.2) = 2 < 3, untouched
    # mean = (3 - 1.2 + 2) / 3 = 3.8 / 3; without dual clip (5 - 1.2 + 2) / 3 = 5.8 / 3
    lps, advs, mask = [0.0, math.log(5), math.log(5), math.log(2)], [0.0, -1.0, 1.0, -1.0], [0, 1, 1, 1]
    _, loss, m = _call(LossConfig(loss_type="ppo", dual_clip_c=3.0), lps, advs, mask, [4])
    assert loss.item() == pytest.approx(3.8 / 3, abs=1e-12)
    assert m["dual_clip_fraction"].item() == pytest.approx(1 / 3)
    _, plain, m0 = _call(LossConfig(loss_type="ppo"), lps, advs, mask, [4])
    assert plain.item() == pytest.approx(5.8 / 3, abs=1e-12)
    assert m0["dual_clip_fraction"].item() == 0.0


def test_gspo_ratio_is_sequence_level() -> None:
    # Sample A (len 3): masked log ratios 0.1, 0.3 -> mean 0.2 -> s_A = e^0.2 = 1.2214 > 1.2: clipped, -1.2 per token
    # Sample B (len 4): masked log ratios -0.3, 0.0, -0.6 -> mean -0.3 -> s_B = e^-0.3 = 0.740818 (inside)
    # A = +1 everywhere. token mean = (2 * -1.2 + 3 * -0.740818) / 5; sequence mean = (-1.2 - 0.740818) / 2
    lps = [0.0, 0.1, 0.3, 0.0, -0.3, 0.0, -0.6]
    mask = [0, 1, 1, 0, 1, 1, 1]
    advs = [float(m) for m in mask]
    s_b = math.exp(-0.3)
    _, loss, m = _call(LossConfig(loss_type="gspo"), lps, advs, mask, [3, 4])
    assert loss.item() == pytest.approx((2 * -1.2 + 3 * -s_b) / 5, abs=1e-12)
    # every token of a sample shares its ratio: extremes are the sequence ratios, not e^-0.6 / e^0.3
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.2))
    assert m["ratio_min"].item() == pytest.approx(s_b)
    assert m["clip_fraction"].item() == pytest.approx(2 / 5)
    _, seq_loss, _ = _call(LossConfig(loss_type="gspo", aggregation="sequence"), lps, advs, mask, [3, 4])
    assert seq_loss.item() == pytest.approx((-1.2 - s_b) / 2, abs=1e-12)


def test_tis_weights_clip() -> None:
    # old - rollout = ln 3, ln 0.5, 0 -> raw weights 3, 0.5, 1 -> clipped at 2: 2, 0.5, 1.
    # logprobs == old (ratio 1), A = +1: loss_t = -w_t -> mean = -(2 + 0.5 + 1) / 3
    # mismatch |old - rollout| mean = (ln 3 + ln 2 + 0) / 3
    old = [0.0, -1.0, -2.0, -0.5]
    rollout = [0.0, -1.0 - math.log(3), -2.0 + math.log(2), -0.5]
    cfg = LossConfig(loss_type="grpo", use_tis=True, tis_clip=2.0)
    _, loss, m = _call(cfg, old, [0.0, 1.0, 1.0, 1.0], [0, 1, 1, 1], [4], old=old, rollout=rollout)
    assert loss.item() == pytest.approx(-3.5 / 3, abs=1e-12)
    assert m["tis_weight_mean"].item() == pytest.approx(3.5 / 3)
    assert m["tis_clip_fraction"].item() == pytest.approx(1 / 3)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx((math.log(3) + math.log(2)) / 3)
    _, no_tis, m0 = _call(LossConfig(loss_type="grpo"), old, [0.0, 1.0, 1.0, 1.0], [0, 1, 1, 1], [4],
                          old=old, rollout=rollout)
    assert no_tis.item() == pytest.approx(-1.0) and m0["tis_weight_mean"].item() == 1.0


def test_mis_masks_tokens_outside_the_range() -> None:
    # The same raw weights 3, 0.5, 1 with mode "mask" and range [0.6, 2]: 3 and 0.5 are outside -> 0, 1 stays.
    # loss_t = -w_t: mean = -(0 + 0 + 1) / 3; weight mean 1/3; 2 of 3 counted as clipped.
    old = [0.0, -1.0, -2.0, -0.5]
    rollout = [0.0, -1.0 - math.log(3), -2.0 + math.log(2), -0.5]
    cfg = LossConfig(loss_type="grpo", use_tis=True, tis_mode="mask", tis_clip=2.0, tis_clip_low=0.6)
    _, loss, m = _call(cfg, old, [0.0, 1.0, 1.0, 1.0], [0, 1, 1, 1], [4], old=old, rollout=rollout)
    assert loss.item() == pytest.approx(-1.0 / 3, abs=1e-12)
    assert m["tis_weight_mean"].item() == pytest.approx(1.0 / 3)
    assert m["tis_clip_fraction"].item() == pytest.approx(2.0 / 3)


@pytest.mark.parametrize(("level", "weights"), [
    # two samples [t0 unmasked, t1, t2] and [t3, t4]; old - rollout: 0, ln 2, ln 3 | ln 0.5, ln 0.25
    ("sequence", [6.0, 6.0, 0.125, 0.125]),  # products over the masked tokens: 2 * 3 = 6; 0.5 * 0.25 = 0.125
    ("geometric", [math.sqrt(6.0), math.sqrt(6.0), math.sqrt(0.125), math.sqrt(0.125)]),  # their geometric means
])
def test_sequence_level_importance_weights(level: str, weights: list[float]) -> None:
    old = [0.0, -1.0, -1.0, -1.0, -1.0]
    rollout = [0.0, -1.0 - math.log(2), -1.0 - math.log(3), -1.0 - math.log(0.5), -1.0 - math.log(0.25)]
    cfg = LossConfig(loss_type="grpo", use_tis=True, tis_level=level, tis_clip=100.0)
    _, loss, m = _call(cfg, old, [0.0, 1.0, 1.0, 1.0, 1.0], [0, 1, 1, 1, 1], [3, 2], old=old, rollout=rollout)
    # ratio 1, A = +1: loss = -(mean of the masked tokens' weights)
    assert loss.item() == pytest.approx(-sum(weights) / 4, rel=1e-12)
    assert m["tis_weight_mean"].item() == pytest.approx(sum(weights) / 4, rel=1e-12)
    clipped = LossConfig(loss_type="grpo", use_tis=True, tis_level=level, tis_clip=2.0)
    _, _, mc = _call(clipped, old, [0.0, 1.0, 1.0, 1.0, 1.0], [0, 1, 1, 1, 1], [3, 2], old=old, rollout=rollout)
    assert mc["tis_clip_fraction"].item() == pytest.approx(0.5)  # sample 1's tokens only (weight > 2)


def test_token_vs_sequence_aggregation_on_unequal_lengths() -> None:
    # SFT loss = -logp. Sample 1 masks one token (logp -2), sample 2 three tokens (logp -1 each).
    # token: (2 + 1 + 1 + 1) / 4 = 1.25   sequence: (2/1 + 3/3) / 2 = 1.5
    lps = [0.0, -2.0, 0.0, -1.0, -1.0, -1.0]
    mask = [0, 1, 0, 1, 1, 1]
    _, tok, _ = _call(LossConfig(loss_type="sft"), lps, [0.0] * 6, mask, [2, 4])
    _, seq, _ = _call(LossConfig(loss_type="sft", aggregation="sequence"), lps, [0.0] * 6, mask, [2, 4])
    assert tok.item() == pytest.approx(1.25, abs=1e-12)
    assert seq.item() == pytest.approx(1.5, abs=1e-12)


def test_loss_token_weights_use_global_counts() -> None:
    # A micro-batch with 2 + 1 masked tokens out of a global batch of 10 tokens / 4 samples.
    mask = _t([0, 1, 1, 0, 1])
    torch.testing.assert_close(loss_token_weights(mask, [3, 2], "token", global_tokens=10),
                               _t([0, 0.1, 0.1, 0, 0.1]))
    torch.testing.assert_close(loss_token_weights(mask, [3, 2], "sequence", global_samples=4),
                               _t([0, 1 / 8, 1 / 8, 0, 1 / 4]))


def test_kl_estimators_by_hand() -> None:
    # logp - ref = 0.5: k1 = 0.5, k2 = 0.5 * 0.25 = 0.125, k3 = e^-0.5 + 0.5 - 1 = 0.1065306597
    lp, ref = _t([-1.0]), _t([-1.5])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.1065306597, abs=1e-10)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.1065306597, abs=1e-10)
    assert kl_penalty(_t([0.0]), _t([-40.0]), "k3").item() == 10.0  # clamped


def test_kl_and_entropy_terms() -> None:
    # A = 0 and ratio 1 -> pg term 0; masked tokens have logp - ref = 0.5 and 0.0:
    # loss = 0.1 * mean(k1) - 0.01 * mean(entropy) = 0.1 * 0.25 - 0.01 * (2 + 1) / 2 = 0.025 - 0.015 = 0.01
    cfg = LossConfig(loss_type="grpo", kl_coef=0.1, kl_type="k1", entropy_coef=0.01)
    lps = [0.0, -1.0, -2.0]
    _, loss, m = _call(cfg, lps, [0.0] * 3, [0, 1, 1], [3], old=lps,
                       ref_logprobs=_t([0.0, -1.5, -2.0]), entropy=_t([9.0, 2.0, 1.0]))
    assert loss.item() == pytest.approx(0.01, abs=1e-12)
    assert m["kl"].item() == pytest.approx(0.25) and m["entropy"].item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _call(cfg, lps, [0.0] * 3, [0, 1, 1], [3], entropy=_t([0.0] * 3))


def test_value_loss_clipped() -> None:
    # t0: V=1, V_old=0.5, R=2: (1-2)^2 = 1; clipped V = 0.5 + 0.2 = 0.7 -> (0.7-2)^2 = 1.69 -> 1.69 (clipped)
    # t1: V=0.4, V_old=0.5, R=0: 0.16; clipped V = 0.4 (inside) -> 0.16
    # loss = 0.5 * (1.69 + 0.16) / 2 = 0.4625
    loss, m = value_loss(_t([1.0, 0.4]), _t([0.5, 0.5]), _t([2.0, 0.0]), _t([1, 1]), [2], value_clip=0.2)
    assert loss.item() == pytest.approx(0.4625, abs=1e-12)
    assert m["value_clip_fraction"].item() == pytest.approx(0.5)
    unclipped, _ = value_loss(_t([1.0, 0.4]), _t([0.5, 0.5]), _t([2.0, 0.0]), _t([1, 1]), [2], value_clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.16) / 2, abs=1e-12)


def test_metric_keys_are_fixed_and_config_is_validated() -> None:
    keys = {"pg_loss", "kl", "entropy", "clip_fraction", "dual_clip_fraction", "ratio_mean", "ratio_max",
            "ratio_min", "tis_weight_mean", "tis_clip_fraction", "train_rollout_logprob_abs_diff"}
    for cfg in (LossConfig(), LossConfig(loss_type="sft"), LossConfig(loss_type="gspo", use_tis=True)):
        _, _, m = _call(cfg, [0.0, -1.0], [0.0, 1.0], [0, 1], [2])
        assert set(m) == keys and all(not v.requires_grad for v in m.values())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(LossConfig(), _t([0.0, -1.0]), _t([0.0, -1.0]), _t([0.0, -1.0]), _t([1.0]), _t([0, 1]), [2])
    with pytest.raises(pydantic.ValidationError):
        LossConfig(eps_clip=-0.1)
    with pytest.raises(pydantic.ValidationError):
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(pydantic.ValidationError):
        LossConfig(loss_type="dpo")


def test_cispo_keeps_a_gradient_on_clipped_tokens() -> None:
    # CISPO, eps 0.2: loss_t = -sg(clip(r_t, 0.8, 1.2)) * A_t * logp_t over the masked tokens (RATIOS, ADVS above).
    #   r=1.5 A=+1 -> w 1.2; r=0.5 A=+1 -> w 0.8; r=1.1 A=-1 -> w 1.1; r=0.7 A=-1 -> w 0.8
    # loss = mean(-w A logp) and d loss / d logp_t = -w_t A_t / 4: -0.3, -0.2, +0.275, +0.2 (none is zero:
    # PPO's clip would zero the first and the last)
    lps = [math.log(r) for r in RATIOS]
    lp, loss, m = _call(LossConfig(loss_type="cispo"), lps, ADVS, MASK, [5])
    w = [0.0, 1.2, 0.8, 1.1, 0.8]
    expected = sum(-wt * a * x for wt, a, x, mk in zip(w, ADVS, lps, MASK, strict=True) if mk) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["clip_fraction"].item() == pytest.approx(0.75)  # 1.5, 0.5 and 0.7 are outside [0.8, 1.2]
    loss.backward()
    torch.testing.assert_close(lp.grad, _t([0.0, -0.3, -0.2, 0.275, 0.2]))
