"""PEFT's LoRA directory, as the trainer writes it and the engines read it (SGLang reads the same files).

A directory holds ``adapter_config.json`` (PEFT's ``LoraConfig``) and ``adapter_model.safetensors`` with one A and
one B per adapted projection: ``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`` [rank, in] and
``...lora_B.weight`` [out, rank]. What the adapters here cannot be (bias, DoRA, per-module ranks, modules saved
whole) is refused when the config is read, before any tensor is. No torch at import: the gateway can read configs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's PEFT directory, beside what the trainer resumes from
# the projections of a Llama / Qwen layer an adapter can sit on (PEFT's names), and the module holding each
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_shapes(hidden: int, q_size: int, kv_size: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a Llama / Qwen layer: the shapes of its B (out x r) and A (r x in)."""
    return {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
            "o_proj": (hidden, q_size), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
            "down_proj": (hidden, intermediate)}


_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                     r"\.weight$")


class AdapterError(ValueError):
    """An adapter directory or tensor set this code cannot serve or train (the message names what)."""


def tensor_name(layer: int, projection: str, matrix: str) -> str:
    """PEFT's name of one adapter matrix (``matrix``: "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{HF_MODULE[projection]}.{projection}.lora_{matrix}.weight"


def parse_tensor_name(name: str) -> tuple[int, str, str]:
    """(layer, projection, "A" | "B") of a PEFT adapter tensor name."""
    m = _TENSOR.match(name)
    if m is None or m.group(3) not in HF_MODULE or HF_MODULE[m.group(3)] != m.group(2):
        raise AdapterError(f"{name!r} is not a LoRA tensor of a Llama / Qwen projection")
    return int(m.group(1)), m.group(3), m.group(4)


class AdapterConfig(BaseModel):
    """What serving and training need of ``adapter_config.json``."""

    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: tuple[str, ...]
    base_model: str | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank  # SGLang's: it reads no use_rslora


def parse_config(config: dict[str, Any], where: str = "adapter") -> AdapterConfig:
    """PEFT's ``LoraConfig`` JSON -> ``AdapterConfig``; AdapterError for anything these adapters cannot be."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    # use_rslora: SGLang 0.5.23 serves alpha / r whatever it says, so such an adapter would be served wrong
    for field, plain in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False), ("use_rslora", False)):
        if config.get(field) not in (None, plain):
            raise AdapterError(f"{where}: {field}={config[field]!r} is not supported (only {plain!r})")
    for field in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(field):
            raise AdapterError(f"{where}: {field} is not supported")
    targets = config.get("target_modules")
    if targets == "all-linear":
        targets = list(PROJECTIONS)
    if isinstance(targets, str) or not targets:
        raise AdapterError(f"{where}: target_modules must list projections (got {targets!r})")
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown:
        raise AdapterError(f"{where}: target modules {unknown} are not projections of a Llama / Qwen layer "
                           f"({', '.join(PROJECTIONS)})")
    try:
        return AdapterConfig(rank=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
                             dropout=float(config.get("lora_dropout") or 0.0),
                             targets=tuple(t for t in PROJECTIONS if t in targets),
                             base_model=config.get("base_model_name_or_path"))
    except (KeyError, ValueError, TypeError) as e:
        raise AdapterError(f"{where}: bad adapter config ({e})") from None


def read_config(directory: str | Path) -> AdapterConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{directory} is not a LoRA adapter directory (no {CONFIG_FILE})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: not JSON ({e})") from None
    return parse_config(config, str(directory))
