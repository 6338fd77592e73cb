"""A multi-adapter LoRA trainer's step changes only the adapters its samples go through.

Why this is needed: Megatron's optimizer steps every parameter it holds, and a stacked adapter parameter
([adapters, ...]) is one parameter for all of them. An adapter with no sample in the batch gets a zero gradient,
but Adam would still move it (its momentum, weight decay): one user's steps would change another user's adapter.
So the rows of the adapters not in the step, of the parameters, of the optimizer's own copies (fp32 main
parameters where the model is bf16) and of their Adam moments, are put back as they were after the step. What
stays shared is Adam's step count (one per parameter): an adapter that joins late gets the bias correction of
the job's step, not of its own first step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from slime_server.lora_format import parse_tensor_name
from slime_server.trainer.lora import initial_a, is_adapter_name
from slime_server.trainer.model import unwrap
from slime_server.trainer.peft_io import adapter_state, load_adapter_state, peft_name


def stacked_adapters(model: nn.Module) -> list[nn.Parameter]:
    """The stacked ([adapters, ...]) adapter parameters of a multi-adapter trainer (none in a one-adapter one)."""
    return [p for name, p in unwrap(model).named_parameters() if is_adapter_name(name) and p.dim() == 3]


def _optimizer_copies(optimizer: Any) -> tuple[dict[int, torch.Tensor], dict[int, Any]]:
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


@contextmanager
def only_adapters(bundle: Any, used: set[int]) -> Iterator[None]:
    """Around an optimizer step: every adapter not in ``used`` comes out of it exactly as it went in."""
    params = stacked_adapters(bundle.model)
    count = params[0].shape[0] if params else 0
    keep = [a for a in range(count) if a not in used]
    if not keep:
        yield
        return
    copies, owner = _optimizer_copies(bundle.optimizer)
    tensors: list[torch.Tensor] = []
    for p in params:
        main = copies.get(id(p), p)
        tensors += [p] if main is p else [p, main]
        opt = owner.get(id(main))
        state = opt.state.get(main, {}) if opt is not None else {}
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor) and t.shape == main.shape]
    index = torch.tensor(keep, dtype=torch.long, device=params[0].device)
    saved = [(t, t.detach().index_select(0, index).clone()) for t in tensors]
    yield
    with torch.no_grad():
        for t, rows in saved:
            t.index_copy_(0, index, rows)


def set_adapter(bundle: Any, slot: int, tensors: dict[str, torch.Tensor] | None, seed: int) -> None:
    """Adapter ``slot`` of a multi-adapter trainer becomes ``tensors`` (full, under global Megatron names: a parked
    user's adapter coming back) or a fresh adapter (A as ``attach_lora`` starts that slot, B = 0: the base's
    answers), with no Adam history; every other adapter untouched (collective: the adapters are gathered)."""

    state = adapter_state(bundle.model, copy=True)
    if tensors is not None and set(tensors) != set(state):
        raise ValueError(f"the adapter for slot {slot} does not target this trainer's modules")
    for key, full in state.items():
        if tensors is not None:
            row = tensors[key]
        elif key.endswith("lora_B"):
            row = torch.zeros_like(full[slot])
        else:
            layer, part, _ = parse_tensor_name(peft_name(key))
            row = initial_a(seed + 7919 * slot, layer, part, full.shape[-2], full.shape[-1])
        if row.shape != full[slot].shape:
            raise ValueError(f"{key}: shape {tuple(row.shape)}, this trainer's adapters {tuple(full[slot].shape)}")
        full[slot] = row.to(full.dtype)
    load_adapter_state(bundle.model, state)
    copies, owner = _optimizer_copies(bundle.optimizer)
    with torch.no_grad():
        for p in stacked_adapters(bundle.model):
            main = copies.get(id(p), p)
            if main is not p:
                main[slot].copy_(p[slot])
            opt = owner.get(id(main))
            for t in (opt.state.get(main, {}) if opt is not None else {}).values():
                if isinstance(t, torch.Tensor) and t.shape == main.shape:
                    t[slot].zero_()
