"""Policy-gradient, SFT, KL, entropy and value losses over per-token log-prob tensors.

All tensors are per token and aligned to the tokens ([T] for one sample, [T_total] for a packed
micro-batch whose samples have lengths ``sample_lens``). A loss is ``sum_t w_t * l_t`` where the
weights ``w_t`` carry the normaliser of the GLOBAL batch (see ``loss_token_weights``): then the loss
of a micro-batch is exactly its share of the global loss, and summing (or back-propagating) the
micro-batch losses one by one reproduces the global loss and gradient, however the batch was cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from slime_server.trainer.settings import Aggregation, ISLevel, KLType, LossConfig


def loss_token_weights(
    loss_mask: torch.Tensor, sample_lens: Sequence[int], aggregation: Aggregation, *,
    global_tokens: float | None = None, global_samples: int | None = None,
) -> torch.Tensor:
    """Per-token weights ``w_t`` so that ``sum_t w_t * l_t`` is this slice's share of the global loss.

    token:    w_t = mask_t / (masked tokens in the global batch)
    sequence: w_t = mask_t / (masked tokens of t's sample) / (samples in the global batch)
    The global counts default to this slice's own (the slice is the whole batch). A sample without
    masked tokens still counts as a sample (it contributes a zero mean), as in slime.
    """
    mask = loss_mask.to(torch.float64)
    if sum(sample_lens) != mask.numel():
        raise ValueError(f"sample_lens sum to {sum(sample_lens)} but the mask has {mask.numel()} tokens")
    if aggregation == "token":
        denom = float(mask.sum()) if global_tokens is None else float(global_tokens)
        return mask / max(denom, 1.0)
    lens = torch.tensor(list(sample_lens), dtype=torch.long, device=mask.device)
    per_sample = torch.stack([p.sum() for p in mask.split(list(sample_lens))]) if len(sample_lens) else mask[:0]
    n_samples = len(sample_lens) if global_samples is None else global_samples
    per_token = per_sample.clamp(min=1.0).repeat_interleave(lens)
    return mask / per_token / max(n_samples, 1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: KLType) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3).

    k3 (= low_var_kl) is clamped to [-10, 10] as slime and verl do, because exp(ref - logp) explodes
    on tokens the reference finds very unlikely.
    """
    log_ratio = logprobs - ref_logprobs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    neg = -log_ratio
    return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)


def importance_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, sample_lens: Sequence[int],
                     level: ISLevel) -> torch.Tensor:
    """pi_old / pi_rollout per token: the token's own ratio, or its sample's product (sequence) or
    geometric mean (geometric) of masked-token ratios broadcast to every token of the sample."""
    if level == "token":
        return log_ratio.exp()
    lens = torch.tensor(list(sample_lens), dtype=torch.long, device=log_ratio.device)
    sums = torch.stack([p.sum() for p in (log_ratio * mask).split(list(sample_lens))])
    if level == "geometric":
        sums = sums / torch.stack([p.sum() for p in mask.split(list(sample_lens))]).clamp(min=1.0)
    return sums.exp().repeat_interleave(lens)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _pick_weights(
    token_weights: torch.Tensor | Mapping[str, torch.Tensor] | None, cfg_aggregation: Aggregation,
    loss_mask: torch.Tensor, sample_lens: Sequence[int],
) -> torch.Tensor:
    if token_weights is None:
        return loss_token_weights(loss_mask, sample_lens, cfg_aggregation)
    if isinstance(token_weights, Mapping):
        return token_weights[cfg_aggregation]
    return token_weights


def _clipped_pg(
    cfg: LossConfig, log_ratio: torch.Tensor, advantages: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip (asymmetric, dual-clip) per token -> (loss, ratio, clipped?, dual-clipped?)."""
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if cfg.dual_clip_c is not None:
        pg3 = -advantages * cfg.dual_clip_c
        dual = (advantages < 0) & (loss > pg3)
        loss = torch.where(dual, pg3, loss)
    return loss, ratio, clipped, dual


def policy_loss(
    cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor, loss_mask: torch.Tensor, sample_lens: Sequence[int], *,
    ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss of one (micro-)batch and its metrics.

    ``logprobs`` carry the gradient; ``old_logprobs`` are the policy that the ratio is taken against
    (trainer-side, before this update), ``rollout_logprobs`` what the engine recorded (used only by
    TIS and the mismatch metric). ``token_weights``: a tensor of per-token weights, or a mapping
    aggregation -> weights (``MicroBatch.token_weights``) from which ``cfg.aggregation`` is taken, or
    None to treat this call as the whole batch. Metrics are means over this call's masked tokens
    (``*_max``/``*_min`` are extremes), always the same keys, detached.
    """
    for name, t in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs),
                    ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(logprobs.shape)}")
    like = {"device": logprobs.device, "dtype": logprobs.dtype}  # inputs may come packed on the CPU
    mask = loss_mask.to(**like)
    weights = _pick_weights(token_weights, cfg.aggregation, mask, sample_lens).to(**like)
    old = old_logprobs.to(**like).detach()
    rollout = rollout_logprobs.to(**like)
    adv = advantages.to(**like)
    on = mask > 0
    zero = logprobs.new_zeros(())

    if cfg.loss_type == "sft":
        per_token = -logprobs
        ratio = torch.ones_like(logprobs)
        clipped = dual = torch.zeros_like(on)
    elif cfg.loss_type == "cispo":
        # CISPO (MiniMax-M1): REINFORCE weighted by the clipped, stop-gradient IS ratio, so every token keeps a
        # gradient (PPO's clip zeroes those outside the range): loss_t = -sg(clip(r_t)) * A_t * logp_t
        ratio = (logprobs - old).exp()
        weight = ratio.detach().clamp(1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
        per_token = -weight * adv * logprobs
        clipped = (ratio.detach() < 1.0 - cfg.eps_clip) | (ratio.detach() > 1.0 + cfg.clip_high)
        dual = torch.zeros_like(on)
    else:
        log_ratio = logprobs - old
        if cfg.loss_type == "gspo":
            lens = torch.tensor(list(sample_lens), dtype=torch.long, device=logprobs.device)
            sums = torch.stack([p.sum() for p in (log_ratio * mask).split(list(sample_lens))])
            counts = torch.stack([p.sum() for p in mask.split(list(sample_lens))]).clamp(min=1.0)
            log_ratio = (sums / counts).repeat_interleave(lens)
        per_token, ratio, clipped, dual = _clipped_pg(cfg, log_ratio, adv)

    tis = torch.ones_like(logprobs)
    if cfg.use_tis:
        raw = importance_ratio(old - rollout, mask, sample_lens, cfg.tis_level)
        outside = (raw > cfg.tis_clip) | (raw < cfg.tis_clip_low)
        if cfg.tis_mode == "truncate":
            tis = raw.clamp(cfg.tis_clip_low, cfg.tis_clip)
        else:
            tis = torch.where(outside, torch.zeros_like(raw), raw)
        per_token = per_token * tis
        tis_clipped = outside
    else:
        tis_clipped = torch.zeros_like(on)

    pg_loss = (per_token * weights).sum()
    loss = pg_loss
    kl = zero
    if cfg.kl_coef > 0 or ref_logprobs is not None:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl_tok = kl_penalty(logprobs, ref_logprobs.to(**like), cfg.kl_type)
        kl = _masked_mean(kl_tok.detach(), mask)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * (kl_tok * weights).sum()
    ent = zero
    if entropy is not None:
        entropy = entropy.to(**like)
        ent = _masked_mean(entropy.detach(), mask)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * (entropy * weights).sum()
    elif cfg.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")

    r_on = ratio.detach()[on]
    metrics = {
        "pg_loss": _masked_mean(per_token.detach(), mask),
        "kl": kl,
        "entropy": ent,
        "clip_fraction": _masked_mean(clipped.to(mask.dtype), mask),
        "dual_clip_fraction": _masked_mean(dual.to(mask.dtype), mask),
        "ratio_mean": _masked_mean(ratio.detach(), mask),
        "ratio_max": r_on.max() if r_on.numel() else logprobs.new_ones(()),
        "ratio_min": r_on.min() if r_on.numel() else logprobs.new_ones(()),
        "tis_weight_mean": _masked_mean(tis.detach(), mask),
        "tis_clip_fraction": _masked_mean(tis_clipped.to(mask.dtype), mask),
        "train_rollout_logprob_abs_diff": _masked_mean((old - rollout).abs(), mask),
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
    sample_lens: Sequence[int], *, value_clip: float | None = 0.2, aggregation: Aggregation = "token",
    token_weights: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2), PPO-style.

    The clip keeps the critic from moving further than ``value_clip`` from the values the
    advantages were computed with. Same weighting rules as ``policy_loss``.
    """
    like = {"device": values.device, "dtype": values.dtype}
    mask = loss_mask.to(**like)
    weights = _pick_weights(token_weights, aggregation, mask, sample_lens).to(**like)
    old = old_values.to(**like).detach()
    ret = returns.to(**like)
    vf1 = (values - ret).square()
    if value_clip is None:
        per_token, clipped = vf1, torch.zeros_like(mask, dtype=torch.bool)
    else:
        v_clip = old + (values - old).clamp(-value_clip, value_clip)
        vf2 = (v_clip - ret).square()
        per_token, clipped = torch.maximum(vf1, vf2), vf2 > vf1
    per_token = 0.5 * per_token
    loss = (per_token * weights).sum()
    metrics = {
        "value_loss": _masked_mean(per_token.detach(), mask),
        "value_clip_fraction": _masked_mean(clipped.to(mask.dtype), mask),
        "value_mean": _masked_mean(values.detach(), mask),
    }
    return loss, metrics
