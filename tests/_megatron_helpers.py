"""Tiny random HF checkpoints for the Megatron tests (every tensor randomised, so biases and
norm weights are not the trivial 0/1 that would hide a mapping mistake)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = dict(
    vocab_size=101,  # odd on purpose: TP=2 must pad the vocab and slice it back
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-5,
)


def make_config(family: str, **overrides: Any) -> Any:
    """A transformers config of ``family`` (llama / mistral / qwen2 / qwen3) with the shared tiny shape."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    return cls(**{**COMMON, **overrides})


def save_random_hf_model(config: Any, path: Path, seed: int = 0) -> Any:
    """Build an HF causal LM from ``config``, randomise every parameter, save_pretrained to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(str(path))
    return model
