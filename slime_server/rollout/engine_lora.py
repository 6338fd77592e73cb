"""LoRA adapters in the CPU engine: many loaded at once over one base, mixed freely in one decode batch.

Every loaded adapter has a slot in stacked per-layer tensors, shaped for the engine's fused matmuls: for qkv an A
of [slots, 3R, H] (q's rows, then k's, then v's), so one matmul gives the rank-space activations of all three, and
a Bᵀ per projection [slots, R, out]; gate/up likewise; o and down a plain pair. R is ``max_lora_rank``: a smaller
adapter's rows and columns past its rank stay zero, and Bᵀ holds ``scaling * Bᵀ`` (SGLang pads to the maximum rank
the same way). Slot 0 is all zeros: the base model's.

A decode step adds every row's own adapter delta ``(x A_sᵀ) Bᵀ_s`` in one gemv.c call per projection group, any mix
of adapters (each row reads its adapter once, Bᵀ as axpys); a prompt (one adapter for all its rows) uses torch's
matmuls; a step with no adapter row does nothing extra. Gathering each row's A and B into one torch bmm (Punica's
BGMV) would copy them per row, and torch's matmuls per adapter cost ~5,000 small ops a step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slime_server.lora_format import (
    PROJECTIONS,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    parse_tensor_name,
    projection_shapes,
    read_config,
)
from slime_server.rollout import gemv

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


@dataclass(frozen=True)
class ModelDims:
    """The base model's shapes an adapter must fit."""

    layers: int
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int

    def shape(self, projection: str) -> tuple[int, int]:
        """(out, in) of a projection."""
        return projection_shapes(self.hidden, self.q_size, self.kv_size, self.intermediate)[projection]


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter in the bank."""

    name: str
    path: str
    config: AdapterConfig
    slot: int
    uid: int  # unique per load: K/V computed under one load is never reused under another (prefix cache)
    pinned: bool = False


class AdapterBank:
    """The engine's loaded adapters and their stacked tensors. Loading and unloading run on the scheduler thread
    (between steps: a step never sees half an adapter); lookups take the lock."""

    def __init__(self, dims: ModelDims, dtype: torch.dtype, max_rank: int, max_loaded: int,
                 target_modules: tuple[str, ...] = PROJECTIONS) -> None:
        self.dims, self.dtype, self.max_rank, self.max_loaded = dims, dtype, max_rank, max_loaded
        self.targets = target_modules
        self.adapters: dict[str, LoadedAdapter] = {}
        self._lock = threading.Lock()
        self._uid = 0
        self._slots = 1  # slot 0: the base (zeros)
        self._slot_groups: dict[int, set[str]] = {}  # slot -> the projection groups its adapter targets
        self.a: list[dict[str, torch.Tensor]] = []  # per layer, per group: [slots, parts * R, in]
        self.b: list[dict[str, list[torch.Tensor]]] = []  # per layer, per group, per projection: Bᵀ [slots, R, out]
        self.kernel = gemv.lora_kernel() if dtype == torch.float32 else None  # a decode batch's deltas in C
        self._alloc(1)

    # ------------------------------------------------------------------ storage
    def _alloc(self, slots: int) -> None:
        """Grow the stacks to ``slots`` (existing slots kept)."""
        r, d = self.max_rank, self.dims
        new_a, new_b = [], []
        for layer in range(d.layers):
            la, lb = {}, {}
            for group, parts in GROUPS.items():
                la[group] = torch.zeros(slots, len(parts) * r, d.shape(parts[0])[1], dtype=self.dtype)
                lb[group] = [torch.zeros(slots, r, d.shape(p)[0], dtype=self.dtype) for p in parts]
                if self.a:
                    la[group][: self._slots] = self.a[layer][group]
                    for new, old in zip(lb[group], self.b[layer][group], strict=True):
                        new[: self._slots] = old
            new_a.append(la)
            new_b.append(lb)
        self.a, self.b, self._slots = new_a, new_b, slots

    def _free_slot(self) -> int:
        used = {a.slot for a in self.adapters.values()}
        free = [s for s in range(1, self._slots) if s not in used]
        if free:
            return free[0]
        self._alloc(self._slots + 1)
        return self._slots - 1

    # ------------------------------------------------------------------ load / unload
    def check(self, config: AdapterConfig, where: str) -> None:
        """AdapterError unless this engine can serve an adapter of ``config``."""
        if config.rank > self.max_rank:
            raise AdapterError(f"{where}: rank {config.rank} is above this engine's --max-lora-rank {self.max_rank}")
        outside = sorted(set(config.targets) - set(self.targets))
        if outside:
            raise AdapterError(f"{where}: target modules {outside} are not in this engine's --lora-target-modules "
                               f"({', '.join(self.targets)})")

    def read(self, path: str) -> tuple[AdapterConfig, dict[tuple[int, str, str], torch.Tensor]]:
        """An adapter directory's config and tensors, checked against the base's shapes (AdapterError naming the
        first misfit; nothing is loaded then)."""
        from safetensors.torch import load_file

        config = read_config(path)
        self.check(config, path)
        weights = Path(path) / WEIGHTS_FILE
        if not weights.is_file():
            raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
        tensors = {parse_tensor_name(k): v for k, v in load_file(str(weights)).items()}
        return config, self.checked(config, tensors, path)

    def checked(self, config: AdapterConfig, tensors: dict[tuple[int, str, str], torch.Tensor], where: str
                ) -> dict[tuple[int, str, str], torch.Tensor]:
        """``tensors`` if they are exactly the adapter ``config`` describes on this base."""
        want = {(layer, p, m) for layer in range(self.dims.layers) for p in config.targets for m in "AB"}
        if set(tensors) != want:
            missing, extra = sorted(want - set(tensors))[:3], sorted(set(tensors) - want)[:3]
            raise AdapterError(f"{where}: tensors do not match its config on this model ({self.dims.layers} "
                               f"layers): missing {missing}, unexpected {extra}")
        for (layer, p, m), t in tensors.items():
            out, fan_in = self.dims.shape(p)
            shape = (config.rank, fan_in) if m == "A" else (out, config.rank)
            if tuple(t.shape) != shape:
                raise AdapterError(f"{where}: layer {layer} {p}.lora_{m} is {tuple(t.shape)}, this base needs "
                                   f"{shape} (an adapter of another model?)")
        return tensors

    def load(self, name: str, path: str, config: AdapterConfig, tensors: dict[tuple[int, str, str], torch.Tensor],
             pinned: bool = False) -> LoadedAdapter:
        """Put a checked adapter into a slot (scheduler thread)."""
        if name in self.adapters:
            raise AdapterError(f"The lora_name {name!r} is already loaded")  # SGLang's refusal, its words
        if len(self.adapters) >= self.max_loaded:
            raise AdapterError(f"{len(self.adapters)} adapters are loaded, --max-loaded-loras is {self.max_loaded}: "
                               "unload one first")
        slot = self._free_slot()
        r = self.max_rank
        for layer in range(self.dims.layers):
            for group, parts in GROUPS.items():
                a = self.a[layer][group][slot]
                a.zero_()
                for i, (p, b_part) in enumerate(zip(parts, self.b[layer][group], strict=True)):
                    b = b_part[slot]
                    b.zero_()
                    if p in config.targets:
                        a[i * r: i * r + config.rank] = tensors[(layer, p, "A")]
                        if self.dtype == torch.float32:  # in place: the same numbers as scaling in fp32, no temporaries
                            b[: config.rank].copy_(tensors[(layer, p, "B")].t()).mul_(config.scaling)
                        else:  # scaled in fp32, rounded once
                            b[: config.rank] = (tensors[(layer, p, "B")].float() * config.scaling).t().to(self.dtype)
        self._slot_groups[slot] = {g for g, parts in GROUPS.items() if set(parts) & set(config.targets)}
        self._uid += 1
        with self._lock:
            loaded = LoadedAdapter(name=name, path=path, config=config, slot=slot, uid=self._uid, pinned=pinned)
            self.adapters[name] = loaded
        return loaded

    def unload(self, name: str) -> LoadedAdapter:
        with self._lock:
            if name not in self.adapters:
                raise AdapterError(f"The lora_name {name!r} is not loaded")
            gone = self.adapters.pop(name)
        self._slot_groups.pop(gone.slot, None)
        return gone

    def get(self, name: str) -> LoadedAdapter | None:
        with self._lock:
            return self.adapters.get(name)

    def listing(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"lora_name": a.name, "lora_path": a.path, "pinned": a.pinned, "rank": a.config.rank}
                    for a in self.adapters.values()]

    # ------------------------------------------------------------------ compute
    def delta(self, layer: int, group: str, x: torch.Tensor, slot: int) -> torch.Tensor:
        """One adapter's contribution to a projection group's output for rows ``x`` [n, in]: [n, out of the group]
        (q | k | v, gate | up: the fused layouts)."""
        h = x @ self.a[layer][group][slot].t()
        bs = self.b[layer][group]
        if len(bs) == 1:
            return h @ bs[0][slot]
        r = self.max_rank
        return torch.cat([h[:, i * r:(i + 1) * r] @ b[slot] for i, b in enumerate(bs)], dim=-1)

    def add_delta(self, out: torch.Tensor, layer: int, group: str, x: torch.Tensor, rows: RowSlots) -> torch.Tensor:
        """``out`` [N, out] plus every adapter's delta on its rows of ``x`` [N, in]: a decode batch's few rows (one
        slot per row) in place through gemv.c (each row reads its adapter once, any mix of adapters in one call),
        a prompt's (one slot for all its rows) with torch's matmuls."""
        if self.kernel is not None and len(rows.slots) == x.shape[0] <= gemv.MAX_ROWS and out.is_contiguous():
            slots = rows.for_group(group, self._slot_groups)
            if slots is not None:
                self.kernel(out, x, slots, self.a[layer][group], self.b[layer][group])
            return out
        for slot, idx in rows.groups:
            if group not in self._slot_groups.get(slot, ()):
                continue  # this adapter leaves the group's projections alone
            if idx is None:
                out = out + self.delta(layer, group, x, slot)
            else:
                out = out.index_add(0, idx, self.delta(layer, group, x.index_select(0, idx), slot))
        return out


@dataclass(frozen=True)
class RowSlots:
    """Which rows of a forward call use which adapter slot: (slot, row indices or None for every row), base rows
    left out."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]
    slots: tuple[int, ...]  # every row's slot
    _by_group: dict[str, torch.Tensor | None] = field(default_factory=dict, compare=False)

    @staticmethod
    def of(slots: list[int]) -> RowSlots | None:
        """None when no row has an adapter (the forward then does nothing extra)."""
        used = sorted(set(slots) - {0})
        if not used:
            return None
        if len(used) == 1 and all(s == used[0] for s in slots):
            return RowSlots(((used[0], None),), tuple(slots))
        return RowSlots(tuple((s, torch.tensor([i for i, x in enumerate(slots) if x == s])) for s in used),
                        tuple(slots))

    def for_group(self, group: str, slot_groups: dict[int, set[str]]) -> torch.Tensor | None:
        """Each row's slot for one projection group (0 where its adapter leaves the group alone), None when no
        row's adapter touches it; computed once per forward call."""
        if group not in self._by_group:
            mine = [s if group in slot_groups.get(s, ()) else 0 for s in self.slots]
            self._by_group[group] = torch.tensor(mine, dtype=torch.int64) if any(mine) else None
        return self._by_group[group]
