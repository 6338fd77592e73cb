"""Supervised fine-tuning through the same Megatron-core trainer (loss type ``sft``).

Why here and not a separate script: a warm start (the CPU demo's, or a user's "teach the format
first") must produce exactly the weights the RL trainer would: same model build, same packing,
same optimizer. So SFT is ``TrainerRank.train_step`` with ``LossConfig(loss_type="sft")`` over
conversations rendered with the served model's own chat template, then an HF export the engines
load like any checkpoint.

``conversation_sample`` renders a conversation turn by turn so that only the assistant's tokens
(what the policy will generate, up to and including its end-of-turn token) carry loss.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from slime_server.buffer.schema import MessageImage
from slime_server.gateway.errors import APIError
from slime_server.gateway.images import expand
from slime_server.trainer.settings import LossConfig, OptimizerSettings
from slime_server.trainer.types import SampleImage, TrainSample
from slime_server.utils.net import find_free_port


class SFTSettings(BaseModel):
    steps: int = Field(250, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(30, ge=0)
    lr_decay: Literal["constant", "cosine"] = Field(
        "constant", description="after warmup: constant (the demo's validated warm start) or cosine down to lr/10")
    seed: int = 0
    max_tokens_per_micro_batch: int = Field(512, gt=0)
    torch_threads: int = Field(2, ge=1)


def conversation_sample(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        *, trained_from: int | None = None, vision: Any = None) -> TrainSample:
    """Tokens of a whole conversation with loss on the assistant messages at index >= ``trained_from``.

    Rendered incrementally (prefix, then each next message) and checked to be prefix-stable, which
    is what the gateway relies on too; a template that rewrites earlier turns raises ValueError.
    A vision-language model's conversation (``vision``: the gateway's ``VisionSpec``) may hold image parts,
    ``{"type": "image", "image": <PNG or JPEG bytes>}``: each placeholder's pad is expanded as the engine expands it
    and the sample carries the images (``TrainSample.images``).
    """
    start = trained_from if trained_from is not None else next(
        (i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    eos = tokenizer.eos_token_id

    def render(upto: int, gen_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(list(messages[:upto]), tools=tools, tokenize=False,
                                             add_generation_prompt=gen_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    ids = render(start, messages[start]["role"] == "assistant" if start < len(messages) else False)
    mask = [0] * len(ids)
    for k in range(start, len(messages)):
        next_is_assistant = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
        new = render(k + 1, next_is_assistant)
        if new[: len(ids)] != ids:
            raise ValueError(f"the chat template is not prefix-stable at message {k}")
        added = new[len(ids):]
        if messages[k]["role"] == "assistant":
            # the policy generates up to its end-of-turn token; what the template adds after it is not
            end = added.index(eos) + 1 if eos in added else len(added)
            mask += [1] * end + [0] * (len(added) - end)
        else:
            mask += [0] * len(added)
        ids = new
    mask[0] = 0
    images = [p["image"] for m in messages if isinstance(m.get("content"), list) for p in m["content"]
              if isinstance(p, dict) and p.get("type") == "image"]
    shown = []
    if images:
        ids, mask, shown = _expanded(ids, mask, images, vision)
    return TrainSample(tokens=ids, loss_mask=mask, rollout_logprobs=[0.0] * len(ids),
                       weight_versions=[-1] * len(ids), images=shown)


def _expanded(ids: list[int], mask: list[int], images: list[bytes], vision: Any) -> tuple[list[int], list[int], list[Any]]:
    """A conversation's ids with each image's one pad expanded to its count (mask 0), and its ``SampleImage``s."""
    import hashlib
    import io

    from PIL import Image

    if vision is None:
        raise ValueError("a conversation with images needs the vision-language model's VisionSpec")
    meta = []
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            meta.append(MessageImage(sha256=hashlib.sha256(data).hexdigest(), tokens=vision.tokens(img.width, img.height)))
    try:
        out_ids, spans = expand(ids, vision.pad_id, meta)  # the gateway's expansion: the engine's counts
    except APIError as e:
        raise ValueError(e.message) from None
    kept = iter(m for t, m in zip(ids, mask, strict=True) if t != vision.pad_id)  # every other position keeps its mask
    out_mask = [0 if t == vision.pad_id else next(kept) for t in out_ids]
    shown = [SampleImage(offset=s["offset"], length=s["length"], sha256=s["sha256"], data=data)
             for s, data in zip(spans, images, strict=True)]
    return out_ids, out_mask, shown


def _export_vision_language(base: Path, trained: dict[str, Any], out: Path) -> None:
    """The base checkpoint's files with the trained language model's tensors in place (the vision tower as it was;
    the names are the checkpoint's, which the trainer's export already uses)."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, Any] = {}
    for f in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    unknown = sorted(set(trained) - set(tensors) - {"lm_head.weight"})
    if unknown:
        raise RuntimeError(f"SFT export does not match the model: unexpected {unknown[:5]}")
    for name, t in trained.items():
        if name in tensors:
            tensors[name] = t.to(tensors[name].dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)


def run_sft(hf_path: str | Path, samples: Sequence[TrainSample], settings: SFTSettings, out_dir: str | Path,
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> Path:
    """Train ``settings.steps`` SFT steps on random batches of ``samples``; write an HF directory.

    Runs a single Megatron-core rank in this process (world size 1); call it in a child process
    when the caller must stay free of torch.distributed state.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_server.trainer.actor import (  # lazy: loads torch
        RendezvousInfo,
        TrainerRank,
        TrainerRankSettings,
    )
    from slime_server.trainer.parallel import destroy_parallel  # lazy: loads torch
    from slime_server.trainer.train_step import TrainStepSettings  # lazy: loads torch

    if not samples:
        raise ValueError("SFT needs at least one sample")
    decay: dict[str, Any] = {}
    if settings.lr_decay == "cosine" and settings.steps > settings.warmup_steps:
        decay = {"lr_decay_style": "cosine", "lr_decay_steps": settings.steps, "min_lr": settings.lr / 10}
    rank = TrainerRank(TrainerRankSettings(
        hf_path=str(hf_path), seed=settings.seed, torch_threads=settings.torch_threads,
        optimizer=OptimizerSettings(lr=settings.lr, lr_warmup_steps=settings.warmup_steps,
                                    lr_warmup_init=0.0, adam_beta2=0.98, clip_grad=1.0, **decay),
        train=TrainStepSettings(max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch,
                                loss=LossConfig(loss_type="sft"))),
        RendezvousInfo(rank=0, world_size=1, master_port=find_free_port()))
    rank.setup()
    try:
        rng = random.Random(settings.seed)
        for step in range(1, settings.steps + 1):
            batch = rng.sample(list(samples), min(settings.batch_size, len(samples)))
            metrics = rank.train_step(batch)
            if on_step is not None:
                on_step(step, metrics)
        state = rank.hf_state_dict()
    finally:
        destroy_parallel()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (Path(hf_path) / "preprocessor_config.json").is_file():  # a vision-language checkpoint: its tower kept
        _export_vision_language(Path(hf_path), state, out)
        (out / "slime_sft.json").write_text(json.dumps({"base": str(hf_path), **settings.model_dump()}, indent=2))
        return out
    model = AutoModelForCausalLM.from_pretrained(hf_path, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"SFT export does not match the model: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf_path).save_pretrained(out)
    for extra in Path(hf_path).glob("slime_*.json"):
        shutil.copy(extra, out / extra.name)
    (out / "slime_sft.json").write_text(json.dumps({"base": str(hf_path), **settings.model_dump()}, indent=2))
    return out
