"""On-disk HF <-> Megatron checkpoint conversion (used by tools/convert_*.py and the CLI).

Megatron checkpoint directory written here (format ``slime-megatron-v1``):

    <dir>/model.pt             torch.save of the FULL Megatron state dict: global layer indices,
                               un-sharded tensors, vocab rows = HF vocab size (no TP padding);
                               ``load_megatron_state_into`` shards/pads it for any TP/PP layout.
    <dir>/slime_megatron.json  ``MegatronCheckpointMeta`` (format, versions, layout flags, HF config)
    <dir>/hf/                  every non-weight file of the source HF dir (config.json, tokenizer
                               files, chat template, generation config) so the reverse
                               conversion yields a complete, loadable HF directory.

The HF side is a ``save_pretrained`` directory: config.json + ``*.safetensors``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from slime_server.trainer.convert import hf_to_megatron, megatron_to_hf, read_hf_state_dict
from slime_server.trainer.model import arch_from_hf_config

FORMAT = "slime-megatron-v1"
META_FILE = "slime_megatron.json"
WEIGHTS_FILE = "model.pt"
HF_META_DIR = "hf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class MegatronCheckpointMeta(BaseModel):
    """Sidecar describing a converted Megatron checkpoint."""

    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT
    megatron_core_version: str
    model_type: str
    fused_norms: bool = False
    hf_config: dict[str, Any]


def _hf_config(hf_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(hf_dir))


def _copy_non_weight_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)


def convert_hf_dir_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, fused_norms: bool = False) -> Path:
    """Write a ``slime-megatron-v1`` directory from an HF checkpoint directory."""
    from megatron.core import package_info

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = _hf_config(hf_dir)
    arch = arch_from_hf_config(config)
    state = hf_to_megatron(read_hf_state_dict(hf_dir), arch, fused_norms=fused_norms)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(state, out_dir / WEIGHTS_FILE)
    _copy_non_weight_files(hf_dir, out_dir / HF_META_DIR)
    meta = MegatronCheckpointMeta(
        megatron_core_version=package_info.__version__, model_type=arch.model_type,
        fused_norms=fused_norms, hf_config=json.loads((hf_dir / "config.json").read_text()),
    )
    (out_dir / META_FILE).write_text(meta.model_dump_json(indent=2))
    return out_dir


def read_megatron_dir(mg_dir: str | Path) -> tuple[dict[str, torch.Tensor], MegatronCheckpointMeta]:
    """Full Megatron state dict and metadata of a ``slime-megatron-v1`` directory."""
    mg_dir = Path(mg_dir)
    meta_path = mg_dir / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{mg_dir} is not a {FORMAT} directory (no {META_FILE})")
    meta = MegatronCheckpointMeta.model_validate_json(meta_path.read_text())
    if meta.format != FORMAT:
        raise ValueError(f"unsupported checkpoint format {meta.format!r} (expected {FORMAT!r})")
    state = torch.load(mg_dir / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    return state, meta


def convert_megatron_dir_to_hf(mg_dir: str | Path, out_dir: str | Path) -> Path:
    """Write an HF ``save_pretrained``-style directory (config, tokenizer, model.safetensors)."""
    from safetensors.torch import save_file

    mg_dir, out_dir = Path(mg_dir), Path(out_dir)
    state, _meta = read_megatron_dir(mg_dir)
    hf_meta = mg_dir / HF_META_DIR
    config = _hf_config(hf_meta)
    tensors = {name: t.contiguous() for name, t in megatron_to_hf(state, arch_from_hf_config(config))}
    out_dir.mkdir(parents=True, exist_ok=True)
    _copy_non_weight_files(hf_meta, out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
