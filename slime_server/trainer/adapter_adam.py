"""Each user's own Adam in a multi-adapter (per-user LoRA) trainer.

Why: Adam's step count is one per parameter, and a stacked adapter parameter ([adapters, ...]) holds every user's
adapter. A user seated in a slot at the job's step k, their moments zeroed, would get the bias correction of step k
rather than of their own first step: at betas (0.9, 0.999) their first update is about 3.2 lr per weight, and their
updates stay several times lr for hundreds of steps, a jolt that undid a returning user's taste in one step. So:

- each slot keeps its own step count (``OptimizerBundle.slot_steps``, which checkpoints carry; kept beside the
  optimizer's state, which fused Adams check key by key when loaded), and the update of a slot whose count is not the parameter's is redone with the slot's own
  bias correction (Adam's formula, decoupled weight decay or not: torch's Adam/AdamW, TransformerEngine's and
  apex's FusedAdam);
- a user giving up their slot keeps their moments and count with their saved adapter (``ADAM_FILE`` beside the
  PEFT files), and has them back with it: their next step is the one they would have taken had they never left.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slime_server.trainer.convert import gather_tp, layer_offset, split_for_tp, to_global
from slime_server.trainer.lora import is_adapter_name
from slime_server.trainer.model import unwrap
from slime_server.trainer.pipeline import gather_stages

MOMENTS = ("exp_avg", "exp_avg_sq")
ADAM_FILE = "adam.pt"  # beside a parked user's PEFT files: their Adam moments (full rows) and step count


def stacked_adapters(model: nn.Module) -> list[nn.Parameter]:
    """The stacked ([adapters, ...]) adapter parameters of a multi-adapter trainer (none in a one-adapter one)."""
    return [p for name, p in unwrap(model).named_parameters() if is_adapter_name(name) and p.dim() == 3]


def optimizer_copies(optimizer: Any) -> tuple[dict[int, torch.Tensor], dict[int, Any]]:
    """id(model parameter) -> the tensor the optimizer steps for it; id(that tensor) -> its torch optimizer."""
    copies: dict[int, torch.Tensor] = {}
    owner: dict[int, Any] = {}
    for c in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = c.optimizer
        for g16, g32 in zip(getattr(c, "float16_groups", []), getattr(c, "fp32_from_float16_groups", []),
                            strict=True):
            for p, main in zip(g16, g32, strict=True):
                copies[id(p)] = main
        for group in inner.param_groups:
            for p in group["params"]:
                copies.setdefault(id(p), p)
                owner[id(p)] = inner
    return copies, owner


@dataclass(frozen=True)
class _Stacked:
    """One stacked adapter parameter as the optimizer sees it."""

    key: str  # global Megatron name
    param: nn.Parameter  # the model's
    main: torch.Tensor  # what the optimizer steps (an fp32 copy where the model is bf16)
    opt: Any  # the torch optimizer holding ``main``
    group: dict[str, Any]  # its param group

    def state(self) -> dict[str, Any]:
        return self.opt.state.get(self.main) or {}

    def global_step(self) -> int:
        """The parameter's Adam step count: torch keeps it in the state, the fused Adams in the group."""
        step = self.state().get("step", self.group.get("step", 0))
        return int(float(step))


def _stacked(bundle: Any) -> list[_Stacked]:
    inner = unwrap(bundle.model)
    offset = layer_offset(inner)
    copies, owner = optimizer_copies(bundle.optimizer)
    out = []
    for name, p in inner.named_parameters():
        if not (is_adapter_name(name) and p.dim() == 3):
            continue
        main = copies.get(id(p), p)
        opt = owner.get(id(main))
        if opt is None:
            continue
        group = next(g for g in opt.param_groups if any(q is main for q in g["params"]))
        out.append(_Stacked(to_global(name, offset), p, main, opt, group))
    return out


def slot_steps(bundle: Any, entries: list[_Stacked] | None = None) -> list[int] | None:
    """Each slot's own Adam step count (None: a one-adapter trainer, or no step yet: every count is 0); a trainer
    restored from before the counts were kept gives every slot the parameters' count. ``entries``: ``_stacked``'s,
    when the caller has them."""
    entries = _stacked(bundle) if entries is None else entries
    if not entries or not entries[0].state():
        return None
    if bundle.slot_steps is None:
        bundle.slot_steps = [entries[0].global_step()] * entries[0].main.shape[0]
    return bundle.slot_steps


def _decoupled(opt: Any, group: dict[str, Any]) -> bool:
    """Whether weight decay is AdamW's (applied to the weights) rather than L2 (added to the gradient)."""
    if hasattr(opt, "adam_w_mode"):  # TransformerEngine's and apex's FusedAdam
        return bool(opt.adam_w_mode)
    return isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


@contextmanager
def own_bias_correction(bundle: Any, used: set[int]) -> Iterator[None]:
    """Around an optimizer step: each slot in ``used`` counts the step as its own, and its update is the one Adam
    takes at that count (redone where the parameter's count differs)."""
    entries = _stacked(bundle)
    if not entries:
        yield
        return
    slots = sorted(used)
    counts = list(slot_steps(bundle, entries) or [0] * entries[0].main.shape[0])
    k_before = entries[0].global_step()
    before = [(e, float(e.group["lr"]), float(e.group.get("weight_decay", 0.0)), e.main.detach()[slots].clone())
              for e in entries]
    yield
    k = entries[0].global_step()
    if k == k_before:
        return  # the step was skipped (inf/nan gradients): nothing moved, nothing counts
    for slot in slots:
        counts[slot] += 1
    bundle.slot_steps = counts
    with torch.no_grad():
        for e, lr, wd, rows in before:
            for i, slot in enumerate(slots):
                if counts[slot] != k:
                    e.main[slot] = _adam_update(e, slot, counts[slot], rows[i], lr, wd).to(e.main.dtype)
                    if e.param is not e.main:
                        e.param[slot] = e.main[slot].to(e.param.dtype)


def _adam_update(e: _Stacked, slot: int, n: int, start: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
    """Row ``slot`` as Adam at step count ``n`` moves it from ``start``, with the moments the step left."""
    beta1, beta2 = e.group["betas"]
    state = e.opt.state[e.main]
    m, v = state["exp_avg"][slot].float(), state["exp_avg_sq"][slot].float()
    start = start.float()
    if _decoupled(e.opt, e.group):
        start = start * (1 - lr * wd)
    denom = v.sqrt() / math.sqrt(1 - beta2 ** n) + float(e.group["eps"])
    return start - (lr / (1 - beta1 ** n)) * m / denom


def slot_adam(bundle: Any, slot: int) -> dict[str, Any]:
    """Slot ``slot``'s Adam moments (full rows, under global Megatron names) and its own step count (collective:
    TP gathers, the pipeline stages merged): what a parked user keeps."""
    parts: dict[str, dict[str, torch.Tensor]] = {part: {} for part in MOMENTS}
    entries = _stacked(bundle)
    counts = slot_steps(bundle, entries)
    for e in entries:
        state = e.state()
        for part in MOMENTS:
            local = state.get(part)
            local = torch.zeros_like(e.main) if local is None else local.detach()
            parts[part][e.key] = gather_tp(e.key, e.param, local)[slot].to("cpu", torch.float32, copy=True)
    return {**{part: gather_stages(rows) for part, rows in parts.items()}, "step": counts[slot] if counts else 0}


def set_slot_adam(bundle: Any, slot: int, saved: dict[str, Any] | None) -> None:
    """Slot ``slot``'s Adam moments and count become ``saved`` (``slot_adam``'s), or a fresh start (zero moments,
    count 0); every other slot's untouched."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    entries = _stacked(bundle)
    counts = slot_steps(bundle, entries)
    if counts is None:
        return  # no step yet: every slot's moments are zero and its count 0
    with torch.no_grad():
        for e in entries:
            for part in MOMENTS:
                moment = e.state()[part]
                if saved is None:
                    moment[slot].zero_()
                else:  # a row splits over TP ranks as its stacked parameter does (counted from the end)
                    moment[slot] = split_for_tp(e.key, saved[part][e.key], tp_rank, tp_size).to(moment.dtype)
    counts[slot] = int(saved["step"]) if saved is not None else 0


def save_slot_adam(directory: str | Path, bundle: Any, slot: int) -> None:
    """``slot_adam`` written beside a saved adapter (collective; global rank 0 writes)."""
    import torch.distributed as dist

    state = slot_adam(bundle, slot)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(state, Path(directory) / ADAM_FILE)


def read_slot_adam(directory: str | Path) -> dict[str, Any] | None:
    """A saved adapter's Adam moments and count (None: saved without them, it starts Adam afresh)."""
    path = Path(directory) / ADAM_FILE
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None
