"""Images in the CPU engine's ``/generate``, taken as SGLang 0.5.23 takes them for Qwen2.5-VL (issue 45).

The request holds ``input_ids`` with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image and
``image_data`` (one string an image, in prompt order). As SGLang does (docs/research/sglang-0.5.23-multimodal.md
sections 2-4): each image goes through the checkpoint's Qwen2-VL image processor, its single pad becomes
``grid_t * grid_h * grid_w / merge**2`` pads (every other id stays as the caller sent it), positions are mRoPE's
(``rope_index``; a decode step's position is its index plus ``delta``), and the prompt's answer counts the
expanded ids. A pre-expanded pad run, a bare pad, a count that differs from the images, or an image that does not
decode is a 400 naming it.

The vision tower (HF's module, loaded from the checkpoint's ``visual.*`` tensors, frozen) runs on the scheduler
thread at prefill, only for images at or after the prefill's first computed position: a prompt whose images lie
in a reused prefix runs no vision at all. Each image is keyed by a hash of its processed pixels (SGLang's
``hash_feature``), which replaces its pad ids in the prefix cache's key, so a prefix is reused through an image
only when it is the same image at the same place.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MM_PAD_SHIFT_VALUE = 1_000_000  # SGLang's: prefix-key ids of image positions start here (above any vocabulary)
EMBED_CACHE_IMAGES = 64  # vision outputs kept by image hash (a prompt's n samples and retried turns reuse them)
MAX_IMAGE_BYTES = 20 * 2**20  # a decoded image file larger than this is refused
MAX_IMAGE_PIXELS = 64 * 2**20  # width x height before resizing (PIL's decompression-bomb guard is 89 M)


class ImageError(ValueError):
    """An image request the engine refuses (a 400, with SGLang's wording where it has one)."""


@dataclass(frozen=True)
class PromptImage:
    """One processed image: its patches, grid (t, h, w) in patches, where its pad run starts in the expanded
    ids, how many pads it has and its content hash."""

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    offset: int
    tokens: int
    digest: bytes


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images, its mRoPE positions [3, L] and ``delta`` (decode position = index + delta), and the
    prefix cache's key of its ids (each image's pads replaced by ids derived from its hash)."""

    images: tuple[PromptImage, ...]
    positions: torch.Tensor
    delta: int
    key_ids: list[int]

    @property
    def image_tokens(self) -> int:
        return sum(im.tokens for im in self.images)


class EngineVision:
    """A Qwen2.5-VL checkpoint's image path: processor, vision tower and the placeholder tokens."""

    def __init__(self, model_path: str, config: Any, params: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """``params``: the engine's tensors by checkpoint name; the ``visual.*`` ones are loaded into the vision
        tower and then replaced by its live parameters, so a weight update of the tower lands in it."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        if getattr(config, "model_type", None) != "qwen2_5_vl":
            raise ValueError(f"images need a Qwen2.5-VL checkpoint; {config.model_type!r} has no vision path here")
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.start_id, self.end_id = int(config.vision_start_token_id), int(config.vision_end_token_id)
        self.pad_id = int(config.image_token_id)
        self.tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config, dtype=dtype).eval()
        own = {f"visual.{k}": p for k, p in self.tower.state_dict(keep_vars=True).items()}
        missing = sorted(set(own) - set(params))
        if missing:
            raise ValueError(f"{Path(model_path).name}: the checkpoint lacks vision tensors {missing[:3]}")
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(params[name])
                params[name] = p.data
        self._embeds: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    # ------------------------------------------------------------------ request side (any thread)
    def prepare(self, ids: list[int], image_data: list[str]) -> tuple[list[int], PromptImages]:
        """The expanded ids and the images of one prompt (``ImageError`` for anything SGLang refuses)."""
        slots = self._placeholders(ids, len(image_data))
        expanded: list[int] = []
        images: list[PromptImage] = []
        at = 0
        for i, (slot, data) in enumerate(zip(slots, image_data, strict=True)):
            pixels, grid = self._process(i, data)
            tokens = grid[0] * grid[1] * grid[2] // self.merge ** 2
            expanded += ids[at:slot]
            digest = hashlib.sha256(pixels.numpy().tobytes()).digest()
            images.append(PromptImage(pixels, grid, len(expanded), tokens, digest))
            expanded += [self.pad_id] * tokens
            at = slot + 1
        expanded += ids[at:]
        positions, delta = rope_index(len(expanded), [(im.offset, im.grid) for im in images], self.merge)
        key = list(expanded)
        for im in images:
            key[im.offset:im.offset + im.tokens] = pad_key(im.digest, im.tokens)
        return expanded, PromptImages(tuple(images), positions, delta, key)

    def _placeholders(self, ids: list[int], n_images: int) -> list[int]:
        """Where each image's single pad is; SGLang's checks (its counting regex wants the pad wrapped)."""
        slots = [i for i, t in enumerate(ids) if t == self.pad_id]
        for i in slots:
            before, after = ids[i - 1] if i else None, ids[i + 1] if i + 1 < len(ids) else None
            if before == self.pad_id or after == self.pad_id:
                raise ImageError("input_ids hold an expanded run of <|image_pad|>: send one <|image_pad|> per image "
                                 "between <|vision_start|> and <|vision_end|>; the engine expands it")
            if before != self.start_id or after != self.end_id:
                raise ImageError(f"<|image_pad|> at position {i} is not wrapped in <|vision_start|> ... <|vision_end|>")
        if len(slots) != n_images:
            raise ImageError(f"Prompt has {len(slots)} image placeholders but {n_images} image inputs were provided")
        return slots

    def _process(self, index: int, data: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
        try:
            image = decode_image(data)
            out = self.processor(images=[image], return_tensors="pt")
        except (ImageError, ValueError, OSError) as e:  # SGLang's words for a media error
            raise ImageError(f"An exception occurred while loading IMAGE data at index {index}: {e}") from None
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return out["pixel_values"], grid  # type: ignore[return-value]

    # ------------------------------------------------------------------ scheduler side
    def embeddings(self, mm: PromptImages, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image rows among positions [start, end) of the prompt: (positions, embeddings [n, hidden]), or None
        when no image lies there. Runs the tower for images not seen lately."""
        where: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for im in mm.images:
            lo, hi = max(start, im.offset), min(end, im.offset + im.tokens)
            if lo >= hi:
                continue
            emb = self._embed(im)
            where.append(torch.arange(lo, hi))
            rows.append(emb[lo - im.offset:hi - im.offset])
        return (torch.cat(where), torch.cat(rows)) if rows else None

    def _embed(self, im: PromptImage) -> torch.Tensor:
        cached = self._embeds.get(im.digest)
        if cached is None:
            dtype = next(self.tower.parameters()).dtype
            out = self.tower(im.pixel_values.to(dtype), grid_thw=torch.tensor([im.grid]))
            cached = out.pooler_output if hasattr(out, "pooler_output") else out
            self._embeds[im.digest] = cached
            while len(self._embeds) > EMBED_CACHE_IMAGES:
                self._embeds.popitem(last=False)
        self._embeds.move_to_end(im.digest)
        return cached

    def clear(self) -> None:
        """Forget the vision outputs (the tower's weights changed)."""
        self._embeds.clear()


def decode_image(data: str) -> Any:
    """A PIL image from an ``image_data`` string: a ``data:`` URL or raw base64. URLs and paths are refused: the
    gateway sends images inline (it fetches a remote URL itself when its operator allows)."""
    from PIL import Image

    if not isinstance(data, str) or not data:
        raise ImageError("an image must be a non-empty string (a data URL or base64)")
    if data.startswith(("http://", "https://", "file://", "/")):
        raise ImageError("this engine takes images inline only (a data: URL or base64), not a URL or a path")
    payload = data.split(",", 1)[1] if data.startswith("data:") else data
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"corrupt base64: {e}") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {len(raw)} bytes; at most {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ImageError(f"the image is {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} in all")
        image.load()
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bytes that are no image
        raise ImageError(f"Could not decode image: {type(e).__name__}: {e}") from None
    return image.convert("RGB")


def rope_index(length: int, images: list[tuple[int, tuple[int, int, int]]], merge: int) -> tuple[torch.Tensor, int]:
    """Qwen2.5-VL's mRoPE positions [3, length] of an expanded prompt whose images (pad offset, grid) are given, and
    ``delta`` = max position + 1 - length (HF's and SGLang's ``get_rope_index`` for images: a text run counts on
    from the last position + 1 on all three axes; an image's pads are (t, row, column) of its merged grid added to
    the position where it starts)."""
    pos = torch.empty((3, length), dtype=torch.long)
    nxt, at = 0, 0
    for offset, (t, h, w) in images:
        pos[:, at:offset] = torch.arange(nxt, nxt + offset - at)
        nxt += offset - at
        gh, gw = h // merge, w // merge
        tt = torch.arange(t).repeat_interleave(gh * gw)
        hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
        ww = torch.arange(gw).repeat(t * gh)
        n = t * gh * gw
        pos[:, offset:offset + n] = torch.stack((tt, hh, ww)) + nxt
        nxt += max(t, gh, gw)
        at = offset + n
    pos[:, at:] = torch.arange(nxt, nxt + length - at)
    top = int(pos.max()) + 1 if length else 0
    return pos, top - length


def pad_key(digest: bytes, n: int) -> list[int]:
    """The prefix-key ids of an image's ``n`` pads: four ids above any vocabulary derived from its hash, repeated
    (SGLang's ``pad_values`` idea)."""
    four = [MM_PAD_SHIFT_VALUE + (int.from_bytes(digest[8 * i:8 * i + 8], "little") >> 2) for i in range(4)]
    return [four[i % 4] for i in range(n)]


def positions_of(mm: PromptImages, n: int) -> torch.Tensor:
    """mRoPE positions [3, n] of a sequence's first ``n`` ids: the prompt's, then (a retracted sequence's output
    recomputed) each further index plus ``delta`` on all three axes."""
    prompt = mm.positions.shape[1]
    if n <= prompt:
        return mm.positions[:, :n]
    return torch.cat((mm.positions, (torch.arange(prompt, n) + mm.delta).expand(3, -1)), dim=1)
