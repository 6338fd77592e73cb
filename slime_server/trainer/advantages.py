"""Advantage estimators: rewards (and optionally values, KL, a teacher) -> per-token advantages.

Each function takes ``TrainSample``s and returns copies with ``advantages`` set on every token
(0 where ``loss_mask`` is 0); the input samples are not modified. Sequence-level estimators
(GRPO, Dr.GRPO, REINFORCE++-baseline) broadcast one number per sample to its masked tokens;
token-level ones (REINFORCE++, GAE) work on the sample's masked tokens in order, treating the
tokens in between (tool results, template) as not being steps of the policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from slime_server.trainer.types import TrainSample

Estimator = Literal["grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"]


def broadcast_to_tokens(value: float, loss_mask: Sequence[int]) -> list[float]:
    """``value`` on masked tokens, 0.0 elsewhere."""
    return [float(value) if m else 0.0 for m in loss_mask]


def _with(sample: TrainSample, **update: object) -> TrainSample:
    return sample.model_copy(update=update, deep=True)


def _groups(samples: Sequence[TrainSample]) -> list[list[int]]:
    """Indices by ``group_id``; a sample without one is a group of its own."""
    by_id: dict[str, list[int]] = {}
    groups: list[list[int]] = []
    for i, s in enumerate(samples):
        if s.group_id is None:
            groups.append([i])
        else:
            if s.group_id not in by_id:
                by_id[s.group_id] = []
                groups.append(by_id[s.group_id])
            by_id[s.group_id].append(i)
    return groups


def group_relative_rewards(samples: Sequence[TrainSample], *, normalize_std: bool, eps: float) -> list[float]:
    """Reward minus its group's mean, optionally divided by (group std + eps).

    The std is the unbiased sample std (torch's default, as in slime); a group of one has std 0,
    so its advantage is 0: with nothing to compare against there is no signal.
    """
    out = [0.0] * len(samples)
    for idx in _groups(samples):
        rewards = [samples[i].reward for i in idx]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else 0.0
        for i, r in zip(idx, rewards, strict=True):
            out[i] = (r - mean) / (std + eps) if normalize_std else r - mean
    return out


def grpo_advantages(
    samples: Sequence[TrainSample], *, normalize_std: bool = True, eps: float = 1e-6,
) -> list[TrainSample]:
    """GRPO: (r - group mean) / (group std + eps) on every masked token.

    ``normalize_std=False`` is Dr.GRPO, which drops the std because it over-weights groups whose
    rewards barely differ (too easy or too hard prompts).
    """
    adv = group_relative_rewards(samples, normalize_std=normalize_std, eps=eps)
    return [_with(s, advantages=broadcast_to_tokens(a, s.loss_mask)) for s, a in zip(samples, adv, strict=True)]


def dr_grpo_advantages(samples: Sequence[TrainSample]) -> list[TrainSample]:
    """Dr.GRPO: r - group mean, no std normalisation."""
    return grpo_advantages(samples, normalize_std=False)


def token_rewards(sample: TrainSample, kl: Sequence[float] | None = None, kl_coef: float = 0.0) -> list[float]:
    """KL-shaped per-token rewards: -kl_coef * kl[t] on masked tokens, plus the reward on the last one.

    ``kl`` is a per-token KL estimate aligned to the tokens (e.g. ``losses.kl_penalty`` of the
    rollout vs reference log-probs); None means no shaping.
    """
    masked = [t for t, m in enumerate(sample.loss_mask) if m]
    out = [0.0] * len(sample.tokens)
    for t in masked:
        out[t] = -kl_coef * kl[t] if kl is not None else 0.0
    if masked:
        out[masked[-1]] += sample.reward
    return out


def discounted_returns(rewards: Sequence[float], loss_mask: Sequence[int], gamma: float) -> list[float]:
    """G_t = sum_{s >= t} gamma^(s-t) r_s over the masked steps, 0 on unmasked tokens."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        if loss_mask[t]:
            running = rewards[t] + gamma * running
            out[t] = running
    return out


def _whiten(per_sample: list[list[float]], masks: list[list[int]], *, center: bool, eps: float) -> list[list[float]]:
    """Normalise masked entries by the batch mean and (biased) std over all masked tokens."""
    vals = [v for vs, ms in zip(per_sample, masks, strict=True) for v, m in zip(vs, ms, strict=True) if m]
    if not vals:
        return per_sample
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    shift = mean if center else 0.0
    scale = 1.0 / math.sqrt(var + eps)
    return [[(v - shift) * scale if m else 0.0 for v, m in zip(vs, ms, strict=True)]
            for vs, ms in zip(per_sample, masks, strict=True)]


def reinforce_plus_plus_advantages(
    samples: Sequence[TrainSample], *, gamma: float = 1.0, kl: Sequence[Sequence[float]] | None = None,
    kl_coef: float = 0.0, eps: float = 1e-8,
) -> list[TrainSample]:
    """REINFORCE++: discounted returns of the KL-shaped token rewards, whitened over the batch.

    The global (batch, token-level) normalisation replaces a critic or group baseline.
    """
    returns = [
        discounted_returns(token_rewards(s, kl[i] if kl is not None else None, kl_coef), s.loss_mask, gamma)
        for i, s in enumerate(samples)
    ]
    adv = _whiten(returns, [s.loss_mask for s in samples], center=True, eps=eps)
    return [_with(s, advantages=a) for s, a in zip(samples, adv, strict=True)]


def reinforce_plus_plus_baseline_advantages(
    samples: Sequence[TrainSample], *, kl: Sequence[Sequence[float]] | None = None, kl_coef: float = 0.0,
    eps: float = 1e-8,
) -> list[TrainSample]:
    """REINFORCE++-baseline: reward minus group mean, broadcast (plus per-token KL shaping as returns
    with gamma 1), then divided by the batch std over masked tokens (no re-centring: the group
    baseline already centred it)."""
    centred = group_relative_rewards(samples, normalize_std=False, eps=0.0)
    shaped = []
    for i, s in enumerate(samples):
        rewards = token_rewards(_with(s, reward=centred[i]), kl[i] if kl is not None else None, kl_coef)
        shaped.append(discounted_returns(rewards, s.loss_mask, 1.0))
    adv = _whiten(shaped, [s.loss_mask for s in samples], center=False, eps=eps)
    return [_with(s, advantages=a) for s, a in zip(samples, adv, strict=True)]


def gae_advantages(
    samples: Sequence[TrainSample], values: Sequence[Sequence[float]], *, gamma: float = 1.0, lam: float = 0.95,
    kl: Sequence[Sequence[float]] | None = None, kl_coef: float = 0.0,
) -> list[TrainSample]:
    """GAE for PPO with a critic: sets ``advantages`` and ``returns`` (= advantages + values).

    ``values[i][t]`` is the critic's value at token t of sample i (aligned to the tokens; only
    masked entries are read). The steps are the masked tokens in order; after the last one the
    value is 0 (the episode ended). delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next.
    """
    out = []
    for i, s in enumerate(samples):
        if len(values[i]) != len(s.tokens):
            raise ValueError(f"values[{i}] has {len(values[i])} entries for {len(s.tokens)} tokens")
        rewards = token_rewards(s, kl[i] if kl is not None else None, kl_coef)
        adv = [0.0] * len(s.tokens)
        ret = [0.0] * len(s.tokens)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(len(s.tokens))):
            if not s.loss_mask[t]:
                continue
            delta = rewards[t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            adv[t], ret[t] = next_adv, next_adv + values[i][t]
            next_value = values[i][t]
        out.append(_with(s, advantages=adv, returns=ret))
    return out


def opd_advantages(
    samples: Sequence[TrainSample], *, w_rl: float = 1.0, w_opd: float = 1.0,
    student_logprobs: Sequence[Sequence[float]] | None = None,
) -> list[TrainSample]:
    """On-policy distillation: A_t = w_rl * A_t + w_opd * (teacher_logp_t - student_logp_t) on masked tokens.

    The teacher term is a per-token reverse-KL reward pulling the student towards the teacher
    (OpenClaw-RL's hindsight hints). ``student_logprobs`` default to the recorded rollout log-probs;
    samples without advantages count as A = 0 (pure distillation).
    """
    out = []
    for i, s in enumerate(samples):
        if s.teacher_logprobs is None:
            raise ValueError(f"sample {i} ({s.sample_id}) has no teacher_logprobs")
        student = student_logprobs[i] if student_logprobs is not None else s.rollout_logprobs
        base = s.advantages or [0.0] * len(s.tokens)
        adv = [w_rl * a + w_opd * (tl - sl) if m else 0.0
               for a, tl, sl, m in zip(base, s.teacher_logprobs, student, s.loss_mask, strict=True)]
        out.append(_with(s, advantages=adv))
    return out


class AdvantageConfig(BaseModel):
    """Which estimator the loop runs, with its knobs (GAE needs a critic and is called directly)."""

    estimator: Estimator = "grpo"
    eps: float = Field(1e-6, gt=0, description="GRPO std epsilon")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (estimator gae: PPO with a critic)")
    kl_coef: float = Field(0.0, ge=0, description="KL reward shaping (REINFORCE++ variants)")
    overlong_max_len: int | None = Field(None, ge=1, description="DAPO overlong reward shaping: responses longer "
                                         "than max_len - cache_len generated tokens lose up to 1 (linearly), beyond "
                                         "max_len exactly 1; None = off")
    overlong_cache_len: int = Field(0, ge=0, description="the soft window of the overlong penalty (DAPO's L_cache)")

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        if self.overlong_max_len is not None and self.overlong_cache_len >= self.overlong_max_len:
            raise ValueError("overlong_cache_len must be below overlong_max_len")
        return self


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` generated tokens."""
    soft = max_len - cache_len
    if length <= soft:
        return 0.0
    if length <= max_len:
        return (soft - length) / cache_len
    return -1.0


def shape_rewards(samples: Sequence[TrainSample], cfg: AdvantageConfig) -> list[TrainSample]:
    """Reward shaping every estimator sees (DAPO's overlong penalty)."""
    if cfg.overlong_max_len is None:
        return list(samples)
    return [_with(s, reward=s.reward + overlong_penalty(sum(s.loss_mask), cfg.overlong_max_len, cfg.overlong_cache_len))
            for s in samples]


def ppo_advantages(samples: Sequence[TrainSample], values: Sequence[Sequence[float]], cfg: AdvantageConfig, *,
                   kl: Sequence[Sequence[float]] | None = None, eps: float = 1e-8) -> list[TrainSample]:
    """PPO: GAE over the critic's values (``returns`` = advantages + values, the critic's targets), then the
    advantages whitened over the batch's masked tokens, as slime does; the returns are left as they are."""
    out = gae_advantages(shape_rewards(samples, cfg), values, gamma=cfg.gamma, lam=cfg.lam, kl=kl, kl_coef=cfg.kl_coef)
    adv = _whiten([s.advantages or [] for s in out], [s.loss_mask for s in out], center=True, eps=eps)
    return [s.model_copy(update={"advantages": a}) for s, a in zip(out, adv, strict=True)]


def compute_advantages(
    samples: Sequence[TrainSample], cfg: AdvantageConfig, *, kl: Sequence[Sequence[float]] | None = None,
) -> list[TrainSample]:
    """Dispatch to the configured estimator (GSPO uses GRPO's group-normalised advantages). GAE needs the
    critic's values: ``ppo_advantages``."""
    samples = shape_rewards(samples, cfg)
    if cfg.estimator == "gae":
        raise ValueError("the gae estimator needs the critic's values: use ppo_advantages")
    if cfg.estimator in ("grpo", "gspo"):
        return grpo_advantages(samples, eps=cfg.eps)
    if cfg.estimator == "dr_grpo":
        return dr_grpo_advantages(samples)
    if cfg.estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(samples, gamma=cfg.gamma, kl=kl, kl_coef=cfg.kl_coef)
    return reinforce_plus_plus_baseline_advantages(samples, kl=kl, kl_coef=cfg.kl_coef)


Part = Callable[[list[TrainSample], list[Sequence[float]] | None, list[Sequence[float]] | None], list[TrainSample]]


def per_adapter(samples: Sequence[TrainSample], estimate: Part, *, kl: Sequence[Sequence[float]] | None = None,
                values: Sequence[Sequence[float]] | None = None) -> list[TrainSample]:
    """``estimate(samples, kl, values)`` run on each adapter's samples alone (a multi-adapter LoRA trainer: one
    policy per adapter), in the input's order.

    Why: each adapter is a policy of its own, so its baseline is its own rewards' mean and std; a batch-wide one
    (REINFORCE++'s whitening, PPO's) would shift one user's advantages by how the other users in the step fared.
    (It did not change how often test_lora_per_user's adapters collapsed without a KL term: that was the
    learning rate's doing.) One adapter (every single-adapter job) is the estimate of the whole batch, as before."""
    slots = sorted({s.adapter for s in samples})
    if len(slots) <= 1:
        return estimate(list(samples), list(kl) if kl is not None else None,
                        list(values) if values is not None else None)
    out: list[TrainSample | None] = [None] * len(samples)
    for slot in slots:
        idx = [i for i, s in enumerate(samples) if s.adapter == slot]
        part = estimate([samples[i] for i in idx], [kl[i] for i in idx] if kl is not None else None,
                        [values[i] for i in idx] if values is not None else None)
        for i, sample in zip(idx, part, strict=True):
            out[i] = sample
    return [s for s in out if s is not None]
