"""A multi-adapter LoRA trainer's step changes only the adapters its samples go through.

Why this is needed: Megatron's optimizer steps every parameter it holds, and a stacked adapter parameter
([adapters, ...]) is one parameter for all of them. An adapter with no sample in the batch gets a zero gradient,
but Adam would still move it (its momentum, weight decay): one user's steps would change another user's adapter.
So the rows of the adapters not in the step, of the parameters, of the optimizer's own copies (fp32 main
parameters where the model is bf16) and of their Adam moments, are put back as they were after the step; and each
adapter in the step is updated at its own Adam step count (``adapter_adam``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from slime_server.lora_format import parse_tensor_name
from slime_server.trainer.adapter_adam import (
    optimizer_copies,
    own_bias_correction,
    set_slot_adam,
    stacked_adapters,
)
from slime_server.trainer.lora import initial_a
from slime_server.trainer.peft_io import adapter_state, load_adapter_state, peft_name

__all__ = ["only_adapters", "set_adapter", "stacked_adapters"]


@contextmanager
def only_adapters(bundle: Any, used: set[int]) -> Iterator[None]:
    """Around an optimizer step: every adapter not in ``used`` comes out of it exactly as it went in; those in it
    are updated at their own Adam step count."""
    params = stacked_adapters(bundle.model)
    if not params:  # a one-adapter or full-weight trainer: nothing to isolate, one step count
        yield
        return
    keep = [a for a in range(params[0].shape[0]) if a not in used]
    if not keep:
        with own_bias_correction(bundle, used):
            yield
        return
    copies, owner = optimizer_copies(bundle.optimizer)
    tensors: list[torch.Tensor] = []
    for p in params:
        main = copies.get(id(p), p)
        tensors += [p] if main is p else [p, main]
        opt = owner.get(id(main))
        state = opt.state.get(main, {}) if opt is not None else {}
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor) and t.shape == main.shape]
    index = torch.tensor(keep, dtype=torch.long, device=params[0].device)
    saved = [(t, t.detach().index_select(0, index).clone()) for t in tensors]
    with own_bias_correction(bundle, used):
        yield
    with torch.no_grad():
        for t, rows in saved:
            t.index_copy_(0, index, rows)


def set_adapter(bundle: Any, slot: int, tensors: dict[str, torch.Tensor] | None, seed: int,
                adam: dict[str, Any] | None = None) -> None:
    """Adapter ``slot`` of a multi-adapter trainer becomes ``tensors`` (full, under global Megatron names: a parked
    user's adapter coming back) or a fresh adapter (A as ``attach_lora`` starts that slot, B = 0: the base's
    answers); its Adam moments and step count ``adam`` (``adapter_adam.slot_adam``'s: the parked user's), or none
    (Adam starts afresh for it); every other adapter untouched (collective: the adapters are gathered)."""

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
    copies, _ = optimizer_copies(bundle.optimizer)
    with torch.no_grad():
        for p in stacked_adapters(bundle.model):
            main = copies.get(id(p), p)
            if main is not p:
                main[slot].copy_(p[slot])
    set_slot_adam(bundle, slot, adam if tensors is not None else None)
