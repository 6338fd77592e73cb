"""A deterministic tiny vision-language model (Qwen2.5-VL's architecture), built locally like the tiny text model.

Why Qwen2.5-VL (issue 45): its language model is Qwen2 (the lean forward's), its images enter as one
``<|vision_start|><|image_pad|><|vision_end|>`` per image that the engine expands, its positions are plain mRoPE
sections, and SGLang serves it through its plain ``get_rope_index``; Qwen3-VL adds deepstack features injected
into the first language layers and interpolated vision position embeddings, more plumbing for no gain here
(docs/research/sglang-0.5.23-multimodal.md). Every vision block attends fully (``fullatt_block_indexes``), so
window attention is a no-op on the small images the tests and the visual demo use.

The directory is a real checkpoint: ``config.json``, safetensors under the names SGLang and HF load
(``model.layers.*``, ``visual.*``), the tiny tokenizer with Qwen's vision tokens, a chat template that renders
image parts, and ``preprocessor_config.json`` for Qwen2-VL's image processor (at most ``max_image_tokens``
tokens an image).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel

from slime_server.models.tiny import TinyModelSpec, build_once, build_tokenizer, default_cache_dir

BUILDER_VERSION = "1"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE_VL_PATH = Path(__file__).with_name("chat_template_vl.jinja")
# CLIP's normalisation, which Qwen2.5-VL's preprocessor_config.json names
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


class TinyVLSpec(BaseModel):
    """Shape of the tiny VLM (~0.9 M parameters with the defaults)."""

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mrope_section: list[int] = [4, 6, 6]  # sums to head_dim / 2 (temporal, height, width frequencies)
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_heads: int = 2
    patch_size: int = 14
    merge_size: int = 2
    min_image_tokens: int = 4  # a smaller image is scaled up to this many tokens (56 x 56 pixels)
    max_image_tokens: int = 64  # a larger one is scaled down to at most this many (e.g. 224 x 224)


def ensure_tiny_vl_model(cache_dir: str | Path | None = None, spec: TinyVLSpec | None = None) -> Path:
    """The tiny VLM's directory, built once (process-safe) if absent."""
    spec = spec or TinyVLSpec()
    digest = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:10]
    return build_once(Path(cache_dir) if cache_dir else default_cache_dir(),
                      f"tiny-qwen2_5_vl-v{BUILDER_VERSION}-{digest}", lambda out: build_tiny_vl_model(out, spec))


def build_tiny_vl_model(out_dir: str | Path, spec: TinyVLSpec | None = None) -> Path:
    """Tokenizer, model (weights from ``spec.seed`` alone) and image-processor config into ``out_dir``."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = spec or TinyVLSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(TinyModelSpec())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE_VL_PATH.read_text()
    tok.save_pretrained(out)
    vs, ve, ip, vp = tok.convert_tokens_to_ids(VISION_TOKENS)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    ids = dict(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    head_dim = spec.hidden_size // spec.num_attention_heads
    if 2 * sum(spec.mrope_section) != head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=-(-len(tok) // 128) * 128, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": spec.mrope_section},
            **ids),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden_size, intermediate_size=spec.vision_intermediate_size,
            num_heads=spec.vision_heads, in_channels=3, patch_size=spec.patch_size, spatial_merge_size=spec.merge_size,
            temporal_patch_size=2, tokens_per_second=2, window_size=112, out_hidden_size=spec.hidden_size,
            fullatt_block_indexes=list(range(spec.vision_depth))),
        image_token_id=ip, video_token_id=vp, vision_start_token_id=vs, vision_end_token_id=ve,
        tie_word_embeddings=True, **ids)
    torch.manual_seed(spec.seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    pixels = (spec.patch_size * spec.merge_size) ** 2
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
        "patch_size": spec.patch_size, "temporal_patch_size": 2, "merge_size": spec.merge_size,
        "min_pixels": spec.min_image_tokens * pixels, "max_pixels": spec.max_image_tokens * pixels,
        "size": {"shortest_edge": spec.min_image_tokens * pixels, "longest_edge": spec.max_image_tokens * pixels},
    }, indent=2))
    (out / "slime_tiny_vl_spec.json").write_text(spec.model_dump_json(indent=2))
    return out
