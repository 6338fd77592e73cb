"""A vision-language model's images in the trainer (issue 45): the same inputs the engine built, rebuilt here.

Why on the trainer: a trajectory stores each image's pads and its file, not its embeddings; the trainer trains the
language model (Megatron's GPTModel, mRoPE) on the image-bearing tokens, so it needs what the engine fed its
language model: each image's embeddings from the vision tower (HF's module, the checkpoint's ``visual.*`` tensors,
frozen) in place of its pads' token embeddings (``decoder_input``), and mRoPE positions (``engine_vision.rope_index``
over each sample's own tokens). The image processor is the checkpoint's, so the pixels, grids and embeddings are the
engine's. Only the first pipeline stage embeds; every stage rotates by the mRoPE positions.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime_server.rollout.engine_model import read_tensors
from slime_server.rollout.engine_vision import rope_index
from slime_server.trainer.types import SampleImage

EMBED_CACHE_IMAGES = 256  # vision outputs kept by content hash (a group's samples share their prompt's images)


@dataclass
class RowImages:
    """A packed row's image inputs: mRoPE positions [3, 1, T] and the image rows' embeddings."""

    positions: torch.Tensor
    rows: torch.Tensor  # long [K]: positions in the row holding image pads
    embeds: torch.Tensor  # [K, hidden]

    def on_rows(self, index: torch.Tensor, num_rows: int) -> RowImages:
        """The same inputs on a token tree's rows (``index``: each packed position's row; a shared row gets its
        samples' identical values: the tree shares an image's pads only where the image and all before agree)."""
        positions = self.positions.new_zeros((3, 1, num_rows))
        positions[:, 0, index] = self.positions[:, 0, :]
        return RowImages(positions, index[self.rows], self.embeds)

    def decoder_input(self, model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input [s, 1, hidden]: the token embeddings, the image rows' replaced by the tower's."""
        emb = model.embedding(input_ids=input_ids, position_ids=position_ids).clone()
        emb[self.rows.to(emb.device), 0] = self.embeds.to(device=emb.device, dtype=emb.dtype)
        return emb


class TrainerVision:
    """The checkpoint's image processor and frozen vision tower."""

    def __init__(self, hf_path: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        cfg = AutoConfig.from_pretrained(hf_path)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(hf_path)
        self.tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg.vision_config, dtype=dtype).eval()
        self.tower.requires_grad_(False)
        tensors = read_tensors(Path(hf_path), set(), prefix="visual.") or {}
        self.tower.load_state_dict({n.removeprefix("visual."): t for n, t in tensors.items()}, strict=True)
        self._seen: OrderedDict[str, tuple[tuple[int, int, int], torch.Tensor]] = OrderedDict()

    def _image(self, image: SampleImage) -> tuple[tuple[int, int, int], torch.Tensor]:
        """An image's grid (t, h, w) and embeddings [pads, hidden], as the engine computed them."""
        seen = self._seen.get(image.sha256)
        if seen is None:
            from PIL import Image

            out = self.processor(images=[Image.open(io.BytesIO(image.data)).convert("RGB")], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
            with torch.no_grad():
                emb = self.tower(out["pixel_values"].to(next(self.tower.parameters()).dtype),
                                 grid_thw=out["image_grid_thw"])
            emb = emb.pooler_output if hasattr(emb, "pooler_output") else emb
            if emb.shape[0] != image.length:
                raise ValueError(f"image {image.sha256[:12]} has {image.length} pads recorded but the processor makes "
                                 f"{emb.shape[0]}: the checkpoint's image processor is not the engine's")
            seen = (grid, emb)  # type: ignore[assignment]
            self._seen[image.sha256] = seen
            while len(self._seen) > EMBED_CACHE_IMAGES:
                self._seen.popitem(last=False)
        self._seen.move_to_end(image.sha256)
        return seen

    def row(self, sample_lens: list[int], images: list[tuple[int, list[SampleImage]]]) -> RowImages:
        """The packed row's ``RowImages``: each sample's mRoPE positions over its own tokens (a sample without
        images: its index on all three axes), its images' embeddings at their pads."""
        parts, rows, embeds = [], [], []
        for n, (start, sample_images) in zip(sample_lens, images, strict=True):
            found = [(im, *self._image(im)) for im in sample_images]
            pos, _ = rope_index(n, [(im.offset, grid) for im, grid, _ in found], self.merge)
            parts.append(pos)
            for im, _, emb in found:
                rows.append(torch.arange(start + im.offset, start + im.offset + im.length))
                embeds.append(emb)
        positions = torch.cat(parts, dim=1)[:, None, :]
        hidden = embeds[0].shape[-1] if embeds else 0
        return RowImages(positions, torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
                         torch.cat(embeds) if embeds else torch.zeros(0, hidden))
