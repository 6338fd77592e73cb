"""The CPU engine's model read straight from a checkpoint directory: config, tensors and RoPE.

Why: building HF's ``AutoModelForCausalLM`` for the lean forward (lean_forward.py) cost every engine start
~1 s of CPU importing transformers' modeling code, and the lean forward uses none of it: it needs the tensors
under their HF names (so weight updates find them), the config and RoPE's frequencies. The suite starts ~70
engines; ``serve`` and the demo start faster too. Architectures and RoPE types the lean forward does not cover
(and ``forward: hf``) still load HF's model (``load_engine_model``), which stays the reference the lean
forward is tested against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LEAN_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl_text"}  # the last: Qwen2.5-VL's LM
# RoPE types whose frequencies do not depend on the sequence length (HF's ``dynamic_rope_update`` recomputes
# "dynamic" and "longrope" per call: those models keep HF's forward)
STATIC_ROPE_TYPES = {"default", "linear", "yarn", "llama3", "proportional"}


def lean_supported(cfg: Any) -> bool:
    """Whether the lean forward computes what HF's model does for ``cfg``: one of its architectures, full
    attention (no sliding window), SiLU MLP without bias, a RoPE whose frequencies are static."""
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    dense_between = int(getattr(cfg, "decoder_sparse_step", 1)) != 1 or bool(getattr(cfg, "mlp_only_layers", None))
    return (getattr(cfg, "model_type", None) in LEAN_MODEL_TYPES and window is None and not dense_between
            and getattr(cfg, "hidden_act", "silu") == "silu" and not getattr(cfg, "mlp_bias", False)
            and rope_type(cfg) in STATIC_ROPE_TYPES)


def rope_type(cfg: Any) -> str:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


class Rope:
    """HF's rotary embedding for these architectures (``LlamaRotaryEmbedding`` and its copies): the same
    frequencies (HF's own init functions for scaled types) and the same float32 arithmetic, so cos/sin are
    bit-identical to the HF model's."""

    def __init__(self, cfg: Any) -> None:
        kind = rope_type(cfg)
        if kind == "default":
            base = cfg.rope_parameters["rope_theta"]
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[kind](cfg)
        params = getattr(cfg, "rope_parameters", None) or {}
        # mRoPE (Qwen2.5-VL): frequency j rotates by the temporal, height or width position, by sections
        section = params.get("mrope_section")
        self.axis = (torch.repeat_interleave(torch.arange(3), torch.tensor(section))[None, None, :]
                     if section else None)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] of ``positions`` [N], or of mRoPE's [3, N] (as HF's ``recomposition``)."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        if positions.dim() == 2:
            freqs = freqs.transpose(0, 1).gather(1, self.axis.expand(freqs.shape[1], 1, freqs.shape[2]))[:, 0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


@dataclass
class EngineModel:
    """What the engine serves from. ``params`` maps every HF state-dict name to its tensor (tied embeddings:
    one tensor under both names), the names weight updates use; ``hf_model`` is set only on HF's path."""

    config: Any
    params: dict[str, torch.Tensor]
    eos_ids: set[int]
    rope: Rope | None = None
    hf_model: torch.nn.Module | None = None
    vl_config: Any = None  # a vision-language checkpoint's whole config (``config`` is its language model's)

    @property
    def weight_bytes(self) -> int:
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in self.params.values()}
        return sum(seen.values())


def state_dict_names(cfg: Any) -> list[str]:
    """The names of HF's state dict for a lean-supported ``cfg`` (the causal-LM model), in its order."""
    kind = cfg.model_type
    biased = kind in ("llama", "qwen3", "qwen3_moe") and getattr(cfg, "attention_bias", False)
    qkv_bias, o_bias = kind in ("qwen2", "qwen2_5_vl_text") or biased, biased
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            names.append(f"{p}self_attn.{proj}_proj.weight")
            if (proj != "o" and qkv_bias) or (proj == "o" and o_bias):
                names.append(f"{p}self_attn.{proj}_proj.bias")
        if kind in ("qwen3", "qwen3_moe"):
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        if kind == "qwen3_moe":  # the checkpoint's layout (SGLang's names): a router, then each expert's three
            names.append(f"{p}mlp.gate.weight")
            names += [f"{p}mlp.experts.{e}.{m}_proj.weight" for e in range(num_experts(cfg)) for m in ("gate", "up", "down")]
        else:
            names += [f"{p}mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    return [*names, "model.norm.weight", "lm_head.weight"]


def num_experts(cfg: Any) -> int:
    """An MoE config's expert count (Qwen3-MoE names it ``num_experts``; transformers 5 saves ``num_local_experts``)."""
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)


def read_tensors(path: Path, wanted: set[str], prefix: str | None = None) -> dict[str, torch.Tensor] | None:
    """``wanted`` tensors (and any whose name starts with ``prefix``) from the directory's safetensors files, or
    None when any wanted one is missing."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in wanted or (prefix and name.startswith(prefix)):
                    out[name] = st.get_tensor(name)
    return out if wanted <= out.keys() else None


def model_eos_ids(path: Path, cfg: Any) -> set[int]:
    """EOS ids of the model config and of ``generation_config.json`` (what HF's ``generation_config`` holds)."""
    ids: set[int] = set()
    found = [getattr(cfg, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.is_file():
        found.append(json.loads(gen.read_text()).get("eos_token_id"))
    for e in found:
        ids.update([e] if isinstance(e, int) else (e or []))
    return ids


def load_engine_model(model_path: str, dtype: torch.dtype, lean: bool) -> EngineModel:
    """The lean path (config, tensors and RoPE, no HF model) when ``lean`` and the checkpoint allows it: a
    supported architecture with every tensor in safetensors files; otherwise HF's model."""
    from transformers import AutoConfig

    path = Path(model_path)
    top = AutoConfig.from_pretrained(model_path)
    vl = getattr(top, "vision_config", None) is not None
    cfg = top.get_text_config() if vl else top
    if vl and not (lean and lean_supported(cfg)):
        raise ValueError(f"{top.model_type}: a vision-language model is served by the lean forward only")
    if lean and lean_supported(cfg):
        names = state_dict_names(cfg)
        tied = bool(getattr(top, "tie_word_embeddings", False))
        wanted = set(names) - ({"lm_head.weight"} if tied else set())
        tensors = read_tensors(path, wanted, prefix="visual." if vl else None)
        if tensors is not None:
            params = {n: tensors[n].to(dtype) for n in [*names, *sorted(tensors.keys() - set(names))] if n in tensors}
            if tied:
                params["lm_head.weight"] = params["model.embed_tokens.weight"]
            return EngineModel(config=cfg, params=params, eos_ids=model_eos_ids(path, top), rope=Rope(cfg),
                               vl_config=top if vl else None)
        if vl:
            raise ValueError(f"{path.name}: the checkpoint lacks some of the language model's tensors")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    # HF's generation_config is generation_config.json when there is one, else the model config's: model_eos_ids reads both
    return EngineModel(config=model.config, params=dict(model.state_dict(keep_vars=True)),
                       eos_ids=model_eos_ids(path, model.config), hf_model=model)
