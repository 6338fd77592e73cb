"""A trained LoRA adapter in Hugging Face PEFT's format, and back.

``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's tensor names
(``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`` [rank, in], ``...lora_B.weight`` [out, rank]):
what ``peft.PeftModel.from_pretrained`` loads and SGLang's ``/load_lora_adapter`` reads (``lora_path``). The
tensors are full: TP shards gathered, pipeline stages merged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slime_server.lora_format import CONFIG_FILE, WEIGHTS_FILE, parse_tensor_name, read_config, tensor_name
from slime_server.trainer.convert import gather_tp, layer_offset, megatron_shards, to_global
from slime_server.trainer.lora import LINEARS, is_adapter_name
from slime_server.trainer.model import unwrap
from slime_server.trainer.pipeline import gather_stages
from slime_server.trainer.settings import LoRASettings

_MEGATRON = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora\.(\w+)\.lora_([AB])$")


def peft_name(megatron_name: str) -> str:
    """``decoder.layers.3.self_attention.linear_qkv.lora.k_proj.lora_A`` -> PEFT's
    ``base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight``."""
    m = _MEGATRON.match(megatron_name)
    if m is None:
        raise KeyError(f"{megatron_name!r} is not a global adapter parameter name")
    return tensor_name(int(m.group(1)), m.group(3), m.group(4))


def megatron_name(peft: str) -> str:
    """Inverse of ``peft_name``."""
    layer, part, matrix = parse_tensor_name(peft)
    linear = next(path for path, (_, parts) in LINEARS.items() if part in parts)
    return f"decoder.layers.{layer}.{linear}.lora.{part}.lora_{matrix}"


def adapter_state(model: nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
    """Every adapter tensor, full, under its global Megatron name, on every rank (collective: TP gathers, then
    the pipeline stages merged). ``copy=False``: CPU parameters come as views (a caller that copies them at once,
    the adapter push)."""
    inner = unwrap(model)
    offset = layer_offset(inner)
    local = {}
    for name, param in inner.named_parameters():
        if is_adapter_name(name):
            key = to_global(name, offset)
            local[key] = gather_tp(key, param, param.detach()).to("cpu", copy=copy)
    return gather_stages(local)


def peft_state_dict(model: nn.Module, adapter: int | None = None, copy: bool = True) -> dict[str, torch.Tensor]:
    """The adapter under PEFT's names (collective); in a multi-adapter trainer, adapter ``adapter``'s."""
    state = adapter_state(model, copy)
    stacked = any(v.dim() == 3 for v in state.values())
    if stacked and adapter is None:
        raise ValueError("this trainer holds several adapters: say which one")
    if not stacked and adapter not in (None, 0):
        raise ValueError(f"this trainer holds one adapter, not adapter {adapter}")
    return {peft_name(k): (v[adapter] if stacked else v).contiguous() for k, v in sorted(state.items())}


def adapter_config(settings: LoRASettings, base_model: str) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` as JSON for this adapter."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
        "target_modules": list(settings.targets), "use_rslora": False, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }


def peft_files(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """A PEFT directory's files (name -> bytes): the config and the tensors by PEFT name. What ``save_peft_adapter``
    writes, and what an adapter push stages on an engine's host (rollout/adapter_staging.py)."""
    from safetensors.torch import save

    return {WEIGHTS_FILE: save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata={"format": "pt"}),
            CONFIG_FILE: json.dumps(config, indent=2).encode()}


def save_peft_adapter(directory: str | Path, model: nn.Module, settings: LoRASettings, base_model: str,
                      adapter: int | None = None) -> Path:
    """Write the adapter (``adapter`` of a multi-adapter trainer) as a PEFT directory (collective; global rank 0
    writes). Returns ``directory``."""
    import torch.distributed as dist

    tensors = peft_state_dict(model, adapter)
    out = Path(directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name, data in peft_files(adapter_config(settings, base_model), tensors).items():
            (out / name).write_bytes(data)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return out


def read_peft_adapter(directory: str | Path) -> tuple[LoRASettings, dict[str, torch.Tensor]]:
    """A PEFT LoRA directory as (settings, full tensors under global Megatron names); refuses what this trainer's
    adapters cannot represent (``lora_format.parse_config``: AdapterError)."""
    from safetensors.torch import load_file

    config = read_config(directory)
    settings = LoRASettings(rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                            target_modules=list(config.targets))
    tensors = {megatron_name(k): v for k, v in load_file(str(Path(directory) / WEIGHTS_FILE)).items()}
    return settings, tensors


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full adapter tensors (global Megatron names) into this rank's adapter shards; every adapter of the
    model must be in ``state`` with its shape, or nothing is copied."""
    shards = list(megatron_shards(unwrap(model), state, trainable_only=True))  # every shape checked before a copy
    with torch.no_grad():
        for param, shard in shards:
            param.copy_(shard)
