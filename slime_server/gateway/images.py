"""Images in /v1 requests (issue 45): read, checked, hashed, and counted in the served model's tokens.

Why here, before the session layer: a prompt's ids must hold each image's pads expanded exactly as the engine
expands them, so the session layer can extend a trajectory token-exactly and the trainer rebuild the same
inputs; the count depends only on the image's size and the checkpoint's image-processor config (Qwen2-VL's
``smart_resize``), so the gateway computes it without touching pixels. Every API's image part becomes one canonical
chat part, ``{"type": "image", "sha256": ..., "tokens": ...}``, which the renderer writes as the model's placeholder
(``<|vision_start|><|image_pad|><|vision_end|>``); the file itself travels beside the request (``TurnImages``), is
stored once per content hash and is sent to the engines as a data URL (SGLang's ``image_data``).

Sources: a ``data:`` URL (or raw base64), an ``http(s)`` URL only when the operator allows fetching
(``gateway.fetch_image_urls``), and ``sha256:<hex>`` for an image this store already holds (what a stored Responses
chain replays). Anything else, a file that is no image, one too large, or any image sent to a text-only model is a
400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slime_server.buffer.schema import ImageBlob
from slime_server.gateway.errors import APIError, bad_request
from slime_server.gateway.threads import in_thread

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen2-VL / Qwen2.5-VL's, one per image
IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
MAX_IMAGE_PIXELS = 64 * 2**20  # width x height, before the engine resizes it
FETCH_TIMEOUT_S = 10.0
CHECKED_REMEMBERED = 4096  # image files whose checks a gateway remembers by content hash


class VisionSpec:
    """What the gateway needs of a vision-language checkpoint: its placeholder's pad id and how many pads an image
    of a given size takes (the image processor's resize rule)."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        proc = json.loads((path / "preprocessor_config.json").read_text())
        self.pad_id = int(cfg["image_token_id"])
        self.patch = int(proc.get("patch_size", 14))
        self.merge = int(proc.get("merge_size", 2))
        size = proc.get("size") or {}
        self.min_pixels = int(size.get("shortest_edge") or proc.get("min_pixels") or 56 * 56)
        self.max_pixels = int(size.get("longest_edge") or proc.get("max_pixels") or 28 * 28 * 1280)

    @staticmethod
    def of(model_dir: str | Path) -> VisionSpec | None:
        """The checkpoint's spec, or None for a text-only model."""
        path = Path(model_dir)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if cfg.get("vision_config") is None or not (path / "preprocessor_config.json").is_file():
            return None
        return VisionSpec(path)

    def tokens(self, width: int, height: int) -> int:
        """Pads an image of this size takes: Qwen2-VL's ``smart_resize`` to multiples of patch x merge within the
        pixel bounds, one pad per merge x merge patches."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch * self.merge
        try:
            h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as e:  # an aspect ratio over 200
            raise bad_request(f"the image cannot be used: {e}") from None
        return (h // factor) * (w // factor)


@dataclass
class TurnImages:
    """The image files of one request (and of the stored chain it continues), by content hash."""

    blobs: dict[str, ImageBlob] = field(default_factory=dict)
    new: list[str] = field(default_factory=list)  # read from this request (stored with the turn if absent)
    by_url: dict[str, str] = field(default_factory=dict)  # each image URL of the request -> its content hash

    def data_urls(self, hashes: list[str]) -> list[str]:
        """SGLang's ``image_data`` for these images, in order."""
        return [f"data:{self.blobs[h].mime};base64,{base64.b64encode(self.blobs[h].data).decode()}" for h in hashes]


class ImageReader:
    """Turns a request's image parts into canonical parts, reading and checking each file once."""

    def __init__(self, spec: VisionSpec | None, model_name: str, *, fetch_urls: bool, max_bytes: int,
                 stored: Any = None, checked: OrderedDict[str, tuple[str, int, int]] | None = None) -> None:
        self.spec, self.model_name, self.fetch_urls, self.max_bytes = spec, model_name, fetch_urls, max_bytes
        self.stored = stored  # store.get_images (sha256: references)
        # files checked lately (hash -> mime, width, height): a conversation resends every earlier image each turn,
        # and decoding each again cost ~7 ms a 1280x720 PNG, a turn (tools/bench_vision_session.py)
        self.checked = checked if checked is not None else OrderedDict()

    async def canonical(self, messages: list[dict[str, Any]], images: TurnImages) -> list[dict[str, Any]]:
        """``messages`` with every ``image_url`` part read into ``images`` and replaced by a canonical part."""
        out = []
        for i, msg in enumerate(messages):
            content = msg.get("content")
            if not isinstance(content, list) or not any(_is_image(p) for p in content):
                out.append(msg)
                continue
            parts = []
            for j, part in enumerate(content):
                if not _is_image(part):
                    parts.append(part)
                    continue
                where = f"messages[{i}].content[{j}]"
                if msg.get("role") not in ("user", "tool"):
                    raise bad_request(f"{where}: images are accepted in user messages and tool results only", param=where)
                blob = await self._read(part, where, images)
                parts.append({"type": "image", "sha256": blob.sha256, "tokens": self.spec.tokens(blob.width, blob.height)})
            out.append({**msg, "content": parts})
        return out

    async def _read(self, part: dict[str, Any], where: str, images: TurnImages) -> ImageBlob:
        if self.spec is None:
            raise bad_request(f"{where}: {self.model_name} is a text-only model; it takes no images", param=where,
                              code="images_not_supported")
        url = part["image_url"]["url"] if isinstance(part.get("image_url"), dict) else part.get("image_url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.image_url.url must be a non-empty string", param=where)
        if url.startswith("sha256:"):
            return await self._stored(url.removeprefix("sha256:"), where, images)
        if url.startswith(("http://", "https://")):
            if not self.fetch_urls:
                raise bad_request(f"{where}: this server does not fetch image URLs (gateway.fetch_image_urls is off); "
                                  "send the image inline as a data URL", param=where, code="image_url_not_allowed")
            data = await self._fetch(url, where)
        elif url.startswith("data:"):
            header, _, payload = url.partition(",")
            if ";base64" not in header:
                raise bad_request(f"{where}: a data URL must be base64 (data:<mime>;base64,...)", param=where)
            data = _b64(payload, where)
        else:
            raise bad_request(f"{where}: an image is a data URL (data:image/png;base64,...) or an http(s) URL",
                              param=where)
        blob = self.blob(data, where)
        images.by_url[url] = blob.sha256
        if blob.sha256 not in images.blobs:
            images.blobs[blob.sha256] = blob
            images.new.append(blob.sha256)
        return blob

    async def _stored(self, digest: str, where: str, images: TurnImages) -> ImageBlob:
        if digest not in images.blobs:
            found = await in_thread(self.stored, [digest]) if self.stored is not None else {}
            if digest not in found:
                raise bad_request(f"{where}: no stored image sha256:{digest}", param=where)
            images.blobs[digest] = found[digest]
        return images.blobs[digest]

    async def _fetch(self, url: str, where: str) -> bytes:
        try:
            async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True) as client, \
                    client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise bad_request(f"{where}: fetching the image answered HTTP {r.status_code}", param=where)
                chunks, size = [], 0
                async for chunk in r.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise bad_request(f"{where}: the image is over {self.max_bytes} bytes", param=where,
                                          code="image_too_large")
                    chunks.append(chunk)
        except httpx.HTTPError as e:
            raise bad_request(f"{where}: the image could not be fetched: {e}", param=where) from None
        return b"".join(chunks)

    def blob(self, data: bytes, where: str) -> ImageBlob:
        """The checked file: a known format, at most ``max_bytes`` and ``MAX_IMAGE_PIXELS``, decodable."""
        from PIL import Image

        if len(data) > self.max_bytes:
            raise bad_request(f"{where}: the image is {len(data)} bytes; at most {self.max_bytes}", param=where,
                              code="image_too_large")
        digest = hashlib.sha256(data).hexdigest()
        known = self.checked.get(digest)
        if known is not None:
            self.checked.move_to_end(digest)
            return ImageBlob(sha256=digest, mime=known[0], width=known[1], height=known[2], data=data)
        try:
            image = Image.open(io.BytesIO(data))
            kind = image.format
            if kind not in IMAGE_FORMATS:
                raise bad_request(f"{where}: {kind} images are not supported (PNG, JPEG, GIF or WebP)", param=where,
                                  code="invalid_image_format")
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise bad_request(f"{where}: the image is {image.width}x{image.height} pixels; at most "
                                  f"{MAX_IMAGE_PIXELS} in all", param=where, code="image_too_large")
            image.load()
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bytes that are no image
            raise bad_request(f"{where}: the data is not an image PIL can read ({type(e).__name__})", param=where,
                              code="invalid_image") from None
        self.checked[digest] = (IMAGE_FORMATS[kind], image.width, image.height)
        while len(self.checked) > CHECKED_REMEMBERED:
            self.checked.popitem(last=False)
        return ImageBlob(sha256=digest, mime=IMAGE_FORMATS[kind], width=image.width, height=image.height, data=data)


def image_reader(gw: Any) -> ImageReader:
    """The gateway's reader: its model's vision spec, its settings, its store and its memory of checked files."""
    return ImageReader(getattr(gw.renderer, "vision", None), gw.model_name, fetch_urls=gw.settings.fetch_image_urls,
                       max_bytes=gw.settings.max_image_bytes, stored=gw.store.get_images, checked=gw.checked_images)


def by_reference(messages: list[dict[str, Any]], images: TurnImages) -> list[dict[str, Any]]:
    """``messages`` with each image URL read in this request replaced by ``sha256:<hash>`` (what a stored record
    keeps: the file itself is in the store once)."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list) and any(_is_image(p) for p in content):
            content = [{"type": "image_url", "image_url": {"url": "sha256:" + images.by_url.get(
                p["image_url"]["url"], p["image_url"]["url"].removeprefix("sha256:"))}} if _is_image(p) else p
                for p in content]
            msg = {**msg, "content": content}
        out.append(msg)
    return out


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _b64(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the image's base64 is corrupt", param=where, code="invalid_image") from None


def expand(ids: list[int], pad_id: int, images: list[Any], offset: int = 0) -> tuple[list[int], list[dict[str, Any]]]:
    """``ids`` with the k-th pad (one per image, as rendered) repeated ``images[k].tokens`` times, and each image's
    span (sha256, offset, length), offsets counted from ``offset``."""
    out: list[int] = []
    spans: list[dict[str, Any]] = []
    k = 0
    for t in ids:
        if t != pad_id:
            out.append(t)
            continue
        if k >= len(images):
            raise bad_request("the rendered prompt holds more image placeholders than the messages have images")
        spans.append({"sha256": images[k].sha256, "offset": offset + len(out), "length": images[k].tokens})
        out += [pad_id] * images[k].tokens
        k += 1
    if k != len(images):
        raise bad_request(f"the rendered prompt holds {k} image placeholders for {len(images)} images")
    return out, spans


@dataclass
class EngineImages:
    """A prompt's images as its engine call needs them: their spans in the (expanded) ids and their data URLs."""

    pad_id: int
    spans: list[Any]  # ImageSpan, by offset
    urls: list[str]

    def request(self, ids: list[int]) -> tuple[list[int], list[str]]:
        """``ids`` with each image's pads collapsed to one, and the images they still hold (a continuation's ids
        extend the prompt: every image is in them)."""
        out: list[int] = []
        urls: list[str] = []
        at = 0
        for span, url in zip(self.spans, self.urls, strict=True):
            if span.offset + span.length > len(ids):
                break
            out += ids[at:span.offset]
            out.append(self.pad_id)
            urls.append(url)
            at = span.offset + span.length
        return out + ids[at:], urls
