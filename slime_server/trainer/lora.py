"""LoRA beside Megatron-core's parallel linear layers: adapters trained over a frozen base.

megatron-core 0.16.1 has no LoRA module, so this one adds, to each targeted ``linear_qkv`` / ``linear_proj`` /
``linear_fc1`` / ``linear_fc2``, a child ``lora`` (one A/B pair per HF projection, PEFT's names) and a forward
hook that adds ``scaling * B A dropout(x)`` to the layer's output. The base module, its parameters and their
names are untouched: the HF conversion, the weight push and the checkpoints see the same model, and an adapter's
parameters are told apart by name (``.lora.<peft name>.lora_A|lora_B``).

One pair per HF projection ("canonical" LoRA, as PEFT): ``linear_qkv`` holds separate q, k and v adapters whose
outputs are laid into Megatron's interleaved per-group layout, ``linear_fc1`` separate gate and up adapters. So an
adapter exports to PEFT's names one to one and q can be targeted without k.

Tensor parallelism, as Megatron-Bridge's ``peft/lora.py`` splits it: on a column-parallel layer (qkv, fc1) the
input is whole on every rank, so A is replicated and B is split by output rows like the base weight (the ranks'
groups of heads, gate and up halves separately); the rank-r activations go through Megatron's
``copy_to_tensor_model_parallel_region`` (backward: all-reduce), so A and the input get their whole gradient on
every rank. On a row-parallel layer (proj, fc2) the input is split, so A is split by input columns, its rank-r
output is summed over the ranks (``reduce_from_tensor_model_parallel_region``) and B is replicated.

A's start is a layout-free function of (seed, layer, projection), so every TP x PP layout starts from the same
adapter; B starts at zero (PEFT's default), so a fresh adapter leaves the base model's outputs exactly as they were.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slime_server.lora_format import projection_shapes
from slime_server.trainer import adapter_rows
from slime_server.trainer.model import ModelArch, unwrap
from slime_server.trainer.settings import LoRASettings

# Megatron linear (under its layer) -> (parallel kind, the HF projections it fuses, in its output order)
LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
ADAPTER_TAG = ".lora."


def is_adapter_name(name: str) -> bool:
    """Whether a (Megatron) parameter name is an adapter's."""
    return ADAPTER_TAG in name


def adapter_partition_dim(name: str) -> int | None:
    """The dimension an adapter parameter is split along over TP ranks (None: replicated): B's rows on a
    column-parallel layer, A's columns on a row-parallel one; counted from the end, so a multi-adapter trainer's
    stacked [adapters, ...] parameters split the same way."""
    linear, _, rest = name.partition(ADAPTER_TAG)
    kind = next((k for suffix, (k, _) in LINEARS.items() if linear.endswith(suffix)), None)
    if kind is None:
        raise KeyError(f"{name!r} is not an adapter parameter")
    matrix = rest.rsplit(".", 1)[-1]
    if kind == "column":
        return -2 if matrix == "lora_B" else None
    return -1 if matrix == "lora_A" else None


def part_sizes(arch: ModelArch, linear: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF projection a Megatron linear fuses (full, unsharded)."""
    shapes = projection_shapes(arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim,
                               arch.ffn_hidden_size)
    return {p: shapes[p] for p in LINEARS[linear][1]}


def interleave_groups(parts: list[torch.Tensor], groups: int, dim: int) -> torch.Tensor:
    """Megatron's qkv layout along ``dim``: for each of ``groups`` KV groups, its slice of q, then of k, of v."""
    dim = dim % parts[0].dim()
    shaped = [p.unflatten(dim, (groups, p.shape[dim] // groups)) for p in parts]
    return torch.cat(shaped, dim=dim + 1).flatten(dim, dim + 1)


def initial_a(seed: int, layer: int, part: str, rank: int, fan_in: int) -> torch.Tensor:
    """PEFT's start for A (Kaiming-uniform, a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))), drawn from a
    generator keyed by (seed, global layer, projection): the same full tensor on every layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 131 + zlib.crc32(part.encode()))
    out = torch.empty(rank, fan_in)
    return nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=gen)


class LoRAPair(nn.Module):
    """One projection's adapter: ``lora_A`` [rank, in / tp on row layers], ``lora_B`` [out / tp on column layers,
    rank]; in a multi-adapter trainer both stacked, [adapters, ...], one row per adapter."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)


class LoRABranch(nn.Module):
    """The adapters of one Megatron linear and how their outputs join its (local) output."""

    def __init__(self, kind: str, pairs: dict[str, LoRAPair], out_local: dict[str, int], groups_local: int,
                 settings: LoRASettings) -> None:
        super().__init__()
        self.kind = kind
        for part, pair in pairs.items():  # children named as the projections: <linear>.lora.<part>.lora_A
            self.add_module(part, pair)
        self.parts = tuple(pairs)
        self.out_local = out_local  # every projection of the linear, targeted or not (zeros fill the others)
        self.groups_local = groups_local  # KV groups on this rank (qkv only; 0 elsewhere)
        self.scaling = settings.scaling
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.enabled = True
        self.stacked = settings.adapters > 1  # a multi-adapter trainer: each row through its own adapter

    @property
    def pairs(self) -> dict[str, LoRAPair]:
        return {part: self.get_submodule(part) for part in self.parts}

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B A dropout(x)`` laid out as the linear's local output."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            get_cuda_rng_tracker,
            reduce_from_tensor_model_parallel_region,
        )

        pairs = self.pairs
        down, up = self._by_adapter(x) if self.stacked else (self._down, self._up)
        if self.kind == "row":
            with get_cuda_rng_tracker().fork():  # the ranks hold different input columns: their own masks
                h = down(x)
            h = reduce_from_tensor_model_parallel_region(h)
        else:
            h = copy_to_tensor_model_parallel_region(down(x))
        ranks = [p.lora_A.shape[-2] for p in pairs.values()]
        outs = {n: up(hp, p) for hp, (n, p) in zip(h.split(ranks, dim=-1), pairs.items(), strict=True)}
        full = [outs.get(n) if n in outs else x.new_zeros(*x.shape[:-1], size) for n, size in self.out_local.items()]
        joined = interleave_groups(full, self.groups_local, -1) if self.groups_local else torch.cat(full, dim=-1)
        return joined * self.scaling

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.dropout(x) @ p.lora_A.t() for p in self.pairs.values()], dim=-1)

    @staticmethod
    def _up(h: torch.Tensor, pair: LoRAPair) -> torch.Tensor:
        return h @ pair.lora_B.t()

    def _by_adapter(self, x: torch.Tensor) -> tuple[Any, Any]:
        """``down`` and ``up`` of a multi-adapter branch (``adapter_rows``; rows are Megatron's leading, sequence
        dimension): packing puts a micro-batch's samples in adapter order, so each adapter's rows are one slice,
        through its own A and B: one pair of matmuls per adapter present, no row copied."""
        rows = adapter_rows.current()
        n = x.shape[0]
        if rows is None:
            rows = torch.zeros(n, dtype=torch.long, device=x.device)
        if rows.numel() != n:
            raise ValueError(f"{rows.numel()} adapter rows for a forward of {n} rows")
        present, counts = torch.unique_consecutive(rows, return_counts=True)
        if present.numel() != present.unique().numel():
            raise ValueError("a multi-adapter forward needs its rows grouped by adapter (packing.py orders them)")
        blocks = list(zip(present.tolist(), counts.tolist(), strict=True))
        pairs = list(self.pairs.values())

        def per_block(t: torch.Tensor, piece: Any) -> torch.Tensor:
            if len(blocks) == 1:
                return piece(blocks[0][0], t)
            return torch.cat([piece(a, part) for (a, _), part in zip(blocks, t.split([c for _, c in blocks]),
                                                                     strict=True)])

        def down(xs: torch.Tensor) -> torch.Tensor:
            return per_block(xs, lambda a, part: torch.cat([self.dropout(part) @ p.lora_A[a].t() for p in pairs], -1))

        def up(h: torch.Tensor, pair: LoRAPair) -> torch.Tensor:
            return per_block(h, lambda a, part: part @ pair.lora_B[a].t())

        return down, up


def _add_delta(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of a targeted linear: its (output, bias) with the adapter's delta added to the output."""
    branch: LoRABranch = module.lora
    if not branch.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + branch.delta(x).to(out.dtype), bias


@dataclass(frozen=True)
class Attached:
    """What ``attach_lora`` did: the adapters' parameter count on this rank and the hooks (removable)."""

    parameters: int
    hooks: tuple[Any, ...]


def _global_layer(layer: nn.Module) -> int:
    return int(layer.layer_number) - 1


def attach_lora(model: nn.Module, settings: LoRASettings, seed: int = 0) -> Attached:
    """Freeze every base parameter of ``model`` (a GPTModel, before DDP wrapping) and add the adapters of
    ``settings`` to this rank's layers (its TP shard, its PP stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    inner = unwrap(model)
    arch: ModelArch = inner.arch
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    wanted = set(settings.targets)
    mlp = wanted & {"gate_proj", "up_proj", "down_proj"}
    if arch.num_experts and mlp:
        raise ValueError(f"LoRA on an MoE model's experts ({', '.join(sorted(mlp))}) is not supported: target the "
                         "attention projections (q_proj, k_proj, v_proj, o_proj)")
    for p in inner.parameters():
        p.requires_grad_(False)
    hooks, count = [], 0
    for layer in inner.decoder.layers:
        index = _global_layer(layer)
        for path, (kind, projections) in LINEARS.items():
            chosen = [p for p in projections if p in wanted]
            if not chosen:
                continue
            linear = layer.get_submodule(path)
            weight = linear.weight
            sizes = part_sizes(arch, path)
            pairs = {}
            for part in chosen:
                out, fan_in = sizes[part]
                # one adapter, or a stack of them (each its own start: seeds apart, the same on every layout)
                starts = [initial_a(seed + 7919 * k, index, part, settings.rank, fan_in)
                          for k in range(settings.adapters)]
                a = starts[0] if settings.adapters == 1 else torch.stack(starts)
                b = torch.zeros(*a.shape[:-2], out, settings.rank)
                if kind == "column":
                    b = b.chunk(tp, dim=-2)[tp_rank]
                else:
                    a = a.chunk(tp, dim=-1)[tp_rank]
                pair = LoRAPair(a.to(weight.device, weight.dtype).contiguous(),
                                b.to(weight.device, weight.dtype).contiguous())
                lead = a.dim() - 2
                set_tensor_model_parallel_attributes(pair.lora_A, kind == "row", lead + (1 if kind == "row" else 0), 1)
                set_tensor_model_parallel_attributes(pair.lora_B, kind == "column", lead, 1)
                pairs[part] = pair
                count += pair.lora_A.numel() + pair.lora_B.numel()
            out_local = {p: sizes[p][0] // (tp if kind == "column" else 1) for p in projections}
            groups = arch.num_kv_heads // tp if path.endswith("linear_qkv") else 0
            linear.lora = LoRABranch(kind, pairs, out_local, groups, settings)
            hooks.append(linear.register_forward_hook(_add_delta, with_kwargs=True))
    return Attached(parameters=count, hooks=tuple(hooks))


def branches(model: nn.Module) -> Iterator[tuple[str, LoRABranch]]:
    """(module path, adapter branch) of every adapted linear on this rank (local layer numbering)."""
    for name, module in unwrap(model).named_modules():
        if isinstance(module, LoRABranch):
            yield name.removesuffix(".lora"), module


def has_adapters(model: nn.Module) -> bool:
    return next(branches(model), None) is not None


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone (every adapter switched off) inside the block: a LoRA job's KL reference, without a
    second copy of the weights."""
    found = [b for _, b in branches(model)]
    for b in found:
        b.enabled = False
    try:
        yield
    finally:
        for b in found:
            b.enabled = True


def full_delta(branch: LoRABranch, pairs_full: dict[str, tuple[torch.Tensor, torch.Tensor]],
               sizes: dict[str, tuple[int, int]], groups: int) -> torch.Tensor:
    """The full (unsharded) ``scaling * B A`` of a Megatron linear from its full A and B per projection,
    in the linear's weight layout (qkv interleaved by KV group, fc1 as [gate; up])."""
    device = next(iter(pairs_full.values()))[0].device
    parts = []
    for part, (out, fan_in) in sizes.items():
        if part in pairs_full:
            a, b = pairs_full[part]
            parts.append((b.float() @ a.float()) * branch.scaling)
        else:  # a projection of the linear the adapter does not target
            parts.append(torch.zeros(out, fan_in, device=device))
    return interleave_groups(parts, groups, 0) if groups else torch.cat(parts, dim=0)
