"""The PPO critic: a Megatron-core value model trained beside the policy, in the same ranks and layout.

It is the policy's architecture initialised from the same checkpoint, with the vocabulary projection
replaced by a value head (hidden -> 1, zero-initialised so the first values are 0 and the first
advantages are plain discounted returns). Values are aligned like log-probs: entry t is the value of
the state that generates token t, read at position t-1; entry 0 of every sample is 0. It has its own
Megatron optimizer and learning rate, and is trained on the clipped value loss (``losses.value_loss``)
against the GAE returns, over the same global-batch weighting as the policy loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from slime_server.trainer.convert import load_hf_checkpoint_into
from slime_server.trainer.losses import value_loss
from slime_server.trainer.model import build_gpt_model, forward_micro_batch
from slime_server.trainer.optimizer import OptimizerBundle, optimizer_step, zero_grads
from slime_server.trainer.packing import MicroBatch, pack_samples, split_packed
from slime_server.trainer.settings import CriticSettings
from slime_server.trainer.train_step import _dp, _gather_rows, _MetricSums, dp_shard
from slime_server.trainer.types import TrainSample


class ValueHead(nn.Module):
    """Stands in for GPTModel's ``output_layer``: (hidden [s, b, h], weight=...) -> (values [s, b, 1], None)."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, 1, dtype=dtype)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
        return self.linear(hidden), None


def build_value_model(hf_path: str, *, params_dtype: torch.dtype = torch.float32,
                      megatron_args: dict[str, Any] | None = None, init_from: str | None = None) -> nn.Module:
    from transformers import AutoConfig

    model = build_gpt_model(AutoConfig.from_pretrained(hf_path), params_dtype=params_dtype, **(megatron_args or {}))
    if torch.cuda.is_available():
        model = model.cuda()
    load_hf_checkpoint_into(model, init_from or hf_path)
    head = ValueHead(model.arch.hidden_size, params_dtype)
    model.output_layer = head.to(next(model.parameters()).device)
    return model


def packed_values(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Values [T] for a micro-batch's packed row, aligned to the tokens (0 where a sample starts)."""
    out = mb.expand(forward_micro_batch(model, mb)[0, :, 0].float())
    return torch.cat([out.new_zeros(1), out[:-1]]).masked_fill(mb.position_ids.to(out.device) == 0, 0.0)


@torch.no_grad()
def compute_values(model: nn.Module, samples: Sequence[TrainSample], max_tokens_per_micro_batch: int = 8192,
                   share_prefixes: bool = True) -> list[torch.Tensor]:
    was_training = model.training
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(samples)
    try:
        for mb in pack_samples(list(samples), max_tokens_per_micro_batch, share_prefixes=share_prefixes):
            v = packed_values(model, mb)
            for idx, piece in zip(mb.sample_indices, split_packed(v.cpu(), mb.sample_lens), strict=True):
                out[idx] = piece
    finally:
        model.train(was_training)
    return [t if t is not None else torch.zeros(0) for t in out]


def critic_step(bundle: OptimizerBundle, samples: Sequence[TrainSample], old_values: Sequence[torch.Tensor],
                settings: CriticSettings, max_tokens_per_micro_batch: int = 8192, share_prefixes: bool = True
                ) -> dict[str, float]:
    """One optimizer step of the critic on ``samples`` (their ``returns``) against ``old_values``."""
    if any(s.returns is None for s in samples):
        raise ValueError("critic training needs samples with returns (GAE)")
    dp_rank, dp_size, dp_group = _dp()
    model = bundle.model
    model.train()
    zero_grads(bundle)
    device = next(model.parameters()).device
    returns = [torch.tensor(s.returns, dtype=torch.float32) for s in samples]
    sums = _MetricSums()
    for mb in pack_samples(list(samples), max_tokens_per_micro_batch, subset=dp_shard(samples, dp_rank, dp_size),
                           share_prefixes=share_prefixes):
        values = packed_values(model, mb)
        loss, metrics = value_loss(values, _gather_rows(old_values, mb, device), _gather_rows(returns, mb, device),
                                   mb.loss_mask.to(device), mb.sample_lens, value_clip=settings.value_clip,
                                   aggregation=settings.aggregation,
                                   token_weights={k: w.to(device) for k, w in mb.token_weights.items()})
        (loss * dp_size).backward()  # the global normaliser already divides by the whole batch
        sums.add(metrics, weight=float(mb.loss_mask.sum()))
    out = sums.reduce(dp_group if dp_size > 1 else None, device)
    result = optimizer_step(bundle)
    out.update(value_grad_norm=result.grad_norm, value_lr=result.lr)
    return out


def explained_variance(values: Sequence[Sequence[float]], returns: Sequence[Sequence[float]],
                       masks: Sequence[Sequence[int]]) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens (1: perfect, <= 0: no better than a mean)."""
    v = torch.tensor([x for vs, ms in zip(values, masks, strict=True) for x, m in zip(vs, ms, strict=True) if m])
    r = torch.tensor([x for rs, ms in zip(returns, masks, strict=True) for x, m in zip(rs, ms, strict=True) if m])
    if r.numel() < 2 or float(r.var()) == 0.0:
        return 0.0
    return float(1.0 - (r - v).var() / r.var())


__all__ = ["ValueHead", "build_value_model", "compute_values", "critic_step", "explained_variance"]
