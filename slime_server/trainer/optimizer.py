"""Megatron DDP + Megatron optimizer + LR/weight-decay schedule for a trainer rank.

Why Megatron's own pieces rather than ``torch.optim.AdamW``: Megatron DDP accumulates gradients
into a contiguous fp32 ``main_grad`` buffer (``param.grad`` stays None), all-reduces it over the
data-parallel group, and Megatron's optimizer reads ``main_grad``, computes the grad norm across
TP ranks without double-counting shared parameters, clips, and keeps fp32 master weights when the
model is bf16 (GPU). A plain torch optimizer on a DDP-wrapped model would silently do nothing.

Schedule semantics are Megatron's ``OptimizerParamScheduler``: the step taken with scheduler
count ``n`` uses ``lr(n)``; the count advances after each successful optimizer step, so with
``lr_warmup_steps > 0`` the first update uses ``lr_warmup_init``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slime_server.trainer.megatron_cpu import apply_cpu_patches, cuda_available
from slime_server.trainer.settings import OptimizerSettings


@dataclass
class OptimizerBundle:
    """What a trainer rank steps: the DDP-wrapped model, its optimizer, and the LR scheduler."""

    model: nn.Module  # megatron.core.distributed.DistributedDataParallel
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer (ChainedOptimizer)
    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    slot_steps: list[int] | None = None  # a multi-adapter trainer's slots' own Adam step counts (adapter_adam)


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step (``updated`` is False when Megatron skipped it: inf/nan grads)."""

    updated: bool
    grad_norm: float
    lr: float


def wrap_ddp(model: nn.Module) -> nn.Module:
    """Wrap a GPTModel in Megatron DDP (fp32 grad buffer, no overlap: grads sync at step time)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if not cuda_available():
        apply_cpu_patches()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def build_optimizer(model: nn.Module, settings: OptimizerSettings) -> OptimizerBundle:
    """DDP-wrap ``model`` (a bare GPTModel) and build Megatron Adam + scheduler for it."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    params_dtype = next(model.parameters()).dtype
    ddp = wrap_ddp(model)
    config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=settings.min_lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(config, [ddp], use_gloo_process_groups=not cuda_available())
    decay_steps = settings.lr_decay_steps or settings.lr_warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=settings.lr_warmup_init, max_lr=settings.lr, min_lr=settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=settings.lr_decay_style, start_wd=settings.weight_decay,
        end_wd=settings.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
    )
    return OptimizerBundle(model=ddp, optimizer=optimizer, scheduler=scheduler)


def zero_grads(bundle: OptimizerBundle) -> None:
    """Clear the DDP grad buffer (``main_grad``) and any optimizer-side grads before accumulation."""
    bundle.model.zero_grad_buffer()
    bundle.optimizer.zero_grad()


def current_lr(bundle: OptimizerBundle) -> float:
    """The learning rate the next optimizer step will use."""
    return float(bundle.optimizer.param_groups[0]["lr"])


def optimizer_step(bundle: OptimizerBundle) -> StepResult:
    """Finalize grads, clip, step Adam, advance the schedule; returns the grad norm (before clipping).

    ``finalize_model_grads`` is Megatron's own post-backward sync: DP all-reduce of the grad
    buffer, plus the TP all-reduce of replicated weights that see only part of the activations
    (Qwen3 q/k layernorm runs per head, so each TP rank holds a partial gradient), plus the
    embedding/output sync across pipeline stages.
    """
    from megatron.core.distributed import finalize_model_grads

    lr = current_lr(bundle)
    finalize_model_grads([bundle.model])
    updated, grad_norm, _ = bundle.optimizer.step()
    if updated:
        bundle.scheduler.step(increment=1)
    return StepResult(updated=bool(updated), grad_norm=float(grad_norm or 0.0), lr=lr)
