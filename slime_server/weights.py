"""Bucket format for weight updates, shared by the trainer (producer) and the engines (consumer).

Why buckets: pushing tensors one by one costs one request each; one flat buffer per ~``max_bytes``
amortises the overhead and maps onto a single shared-memory file or HTTP body. Packing costs exactly
one copy per tensor into a preallocated buffer; by default that buffer is already a ``/dev/shm`` file,
so a same-host push sends only a path. ``unpack`` returns views into the buffer (no copies), so the
engine's only remaining copy is the one into its live parameters at commit time.

Layout: tensors are laid out in order, each starting at a multiple of ``alignment`` bytes (64: a cache
line, and enough for every dtype's natural alignment so views are always legal).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import socket
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from pydantic import BaseModel, Field, field_validator

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's --update-weight-buffer-size default
DEFAULT_ALIGNMENT = 64
META_HEADER = "X-Bucket-Meta"
SHM_DIR = "/dev/shm"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}


def dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dt} is not supported in weight buckets")
    return name


class TensorMeta(BaseModel):
    """Where one tensor lives inside a bucket."""

    name: str
    dtype: str
    shape: list[int]
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in _DTYPES:
            raise ValueError(f"unknown dtype {v!r}")
        return v

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


class BucketMeta(BaseModel):
    """Everything needed to read a bucket's bytes back into named tensors."""

    format_version: int = 1
    alignment: int = Field(DEFAULT_ALIGNMENT, ge=1)
    total_bytes: int = Field(ge=0)
    tensors: list[TensorMeta]

    def check(self) -> None:
        """Refuse metadata that would read outside the buffer or disagree with itself."""
        for t in self.tensors:
            want = math.prod(t.shape) * torch.empty((), dtype=t.torch_dtype).element_size()
            if want != t.nbytes:
                raise ValueError(f"{t.name}: nbytes {t.nbytes} != shape {t.shape} x {t.dtype}")
            if t.offset % torch.empty((), dtype=t.torch_dtype).element_size():
                raise ValueError(f"{t.name}: offset {t.offset} is not aligned for {t.dtype}")
            if t.offset + t.nbytes > self.total_bytes:
                raise ValueError(f"{t.name}: bytes [{t.offset}, {t.offset + t.nbytes}) exceed the bucket")


class BucketUpdateReq(BaseModel):
    """JSON body of ``POST /update_weights_from_bucket`` (same host: the bucket is a shm file)."""

    path: str
    meta: BucketMeta
    weight_version: str | None = None
    last: bool = False

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return None if v is None else str(v)


@dataclass(eq=False)
class Bucket:
    """A flat uint8 buffer plus its metadata; ``path`` is set when the buffer is a shm file."""

    meta: BucketMeta
    buffer: torch.Tensor
    path: str | None = None
    _keepalive: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.meta.total_bytes

    def unlink(self) -> None:
        """Remove the backing shm file now (mappings that exist stay valid until dropped)."""
        if self.path is not None:
            _unlink_quiet(self.path)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _alloc(total: int, shm_dir: str | None) -> tuple[torch.Tensor, str | None, Any]:
    """A writable uint8 buffer: plain memory, or a fresh file in ``shm_dir`` mapped shared."""
    if shm_dir is None or total == 0:
        return torch.empty(total, dtype=torch.uint8), None, None
    fd, path = tempfile.mkstemp(prefix="slime-bucket-", dir=shm_dir)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    return buf, path, mm


def _default_shm_dir() -> str | None:
    return SHM_DIR if os.access(SHM_DIR, os.W_OK) else None


def bucket_layout(group: list[tuple[str, torch.Tensor]], alignment: int) -> BucketMeta:
    """Where each tensor of ``group`` goes in one flat bucket (offsets aligned to ``alignment``)."""
    metas: list[TensorMeta] = []
    off = 0
    for name, t in group:
        off = _align(off, alignment)
        metas.append(TensorMeta(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), offset=off,
                                nbytes=_nbytes(t)))
        off += _nbytes(t)
    return BucketMeta(alignment=alignment, total_bytes=off, tensors=metas)


def fill_bucket(buf: torch.Tensor, group: list[tuple[str, torch.Tensor]], meta: BucketMeta) -> None:
    """The one copy: each source (any device/stride) straight into its slot of the flat buffer."""
    for (_, t), m in zip(group, meta.tensors, strict=True):
        if m.nbytes:
            buf[m.offset:m.offset + m.nbytes].view(t.dtype).view(t.shape).copy_(t.detach())


def _build(group: list[tuple[str, torch.Tensor]], alignment: int, shm_dir: str | None) -> Bucket:
    meta = bucket_layout(group, alignment)
    buf, path, mm = _alloc(meta.total_bytes, shm_dir)
    fill_bucket(buf, group, meta)
    bucket = Bucket(meta=meta, buffer=buf, path=path, _keepalive=mm)
    if path is not None:
        weakref.finalize(bucket, _unlink_quiet, path)  # the producer owns the file
    return bucket


def pack_buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int = DEFAULT_BUCKET_BYTES,
                 alignment: int = DEFAULT_ALIGNMENT, shm_dir: str | None | bool = True) -> Iterator[Bucket]:
    """Pack tensors into buckets of at most ``max_bytes`` (a larger tensor gets a bucket of its own).

    Streams: a bucket is emitted as soon as the next tensor would not fit, so a generator of gathered
    tensors is never held in full. ``shm_dir=True`` puts buffers in ``/dev/shm`` when writable,
    ``None``/``False`` keeps them in process memory, a string names the directory.
    """
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError("alignment must be a power of two")
    where = _default_shm_dir() if shm_dir is True else (shm_dir or None)
    group: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, t in named:
        size = _nbytes(t)
        if group and _align(used, alignment) + size > max_bytes:
            yield _build(group, alignment, where)
            group, used = [], 0
        used = _align(used, alignment) + size
        group.append((name, t))
    if group:
        yield _build(group, alignment, where)


def unpack(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Named views into the bucket's buffer (they share its memory: no copies)."""
    return unpack_buffer(bucket.buffer, bucket.meta)


def unpack_buffer(buffer: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (1-D uint8) as described by ``meta``; validates bounds first."""
    meta.check()
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < meta.total_bytes:
        raise ValueError(f"buffer holds {buffer.numel()} bytes, meta says {meta.total_bytes}")
    out = []
    for m in meta.tensors:
        view = buffer[m.offset:m.offset + m.nbytes].view(m.torch_dtype).view(m.shape)
        out.append((m.name, view))
    return out


def to_bytes(bucket: Bucket) -> memoryview:
    """The raw bytes (a view, no copy) for an HTTP body."""
    return memoryview(bucket.buffer.numpy()).cast("B") if bucket.nbytes else memoryview(b"")


def from_bytes(data: bytes | bytearray | memoryview, meta: BucketMeta) -> Bucket:
    """Wrap received bytes as a bucket without copying (``bytes`` are read-only: views are too)."""
    if len(data) != meta.total_bytes:
        raise ValueError(f"got {len(data)} bytes, meta says {meta.total_bytes}")
    if len(data) == 0:
        return Bucket(meta=meta, buffer=torch.empty(0, dtype=torch.uint8))
    return Bucket(meta=meta, buffer=_readonly_frombuffer(data), _keepalive=data)


def write_shm(bucket: Bucket, shm_dir: str = SHM_DIR) -> Bucket:
    """A copy of ``bucket`` in a new shm file (when it was packed in process memory)."""
    if bucket.path is not None:
        return bucket
    buf, path, mm = _alloc(bucket.nbytes, shm_dir)
    if bucket.nbytes:
        buf.copy_(bucket.buffer[: bucket.nbytes])
    out = Bucket(meta=bucket.meta, buffer=buf, path=path, _keepalive=mm)
    if path is not None:
        weakref.finalize(out, _unlink_quiet, path)
    return out


def read_shm(path: str | Path, meta: BucketMeta) -> Bucket:
    """Map a shm bucket file read-only and wrap it without copying."""
    meta.check()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < meta.total_bytes:
            raise ValueError(f"{path} holds {size} bytes, meta says {meta.total_bytes}")
        if meta.total_bytes == 0:
            return Bucket(meta=meta, buffer=torch.empty(0, dtype=torch.uint8))
        # Read-only shared mapping, pre-faulted in one kernel call (no per-page faults during the copy).
        mm = mmap.mmap(f.fileno(), meta.total_bytes, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    return Bucket(meta=meta, buffer=_readonly_frombuffer(mm), _keepalive=mm)


def _readonly_frombuffer(data: Any) -> torch.Tensor:
    """A uint8 tensor over a read-only buffer; torch warns that writes would fault, and we never write."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


@functools.lru_cache(maxsize=64)
def is_local_host(host: str) -> bool:
    """True when ``host`` is an address of this machine (we can bind to it), so /dev/shm is shared."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def push_bucket(client: httpx.Client, engine_url: str, bucket: Bucket, weight_version: str | int | None = None,
                last: bool = False, transport: str = "auto") -> dict[str, Any]:
    """Send one bucket to an engine's ``/update_weights_from_bucket``; returns its JSON answer.

    ``transport``: ``shm`` (same host: send the file path), ``http`` (send the bytes), or ``auto``
    (shm when the bucket is a file and the engine's address belongs to this machine). The engine
    answers SGLang's ``{"success", "message"}``; a refused bucket raises ``httpx.HTTPStatusError``
    (400) and the engine drops everything staged so far.
    """
    version = None if weight_version is None else str(weight_version)
    if transport == "auto":
        transport = "shm" if bucket.path and is_local_host(httpx.URL(engine_url).host) else "http"
    url = f"{engine_url.rstrip('/')}/update_weights_from_bucket"
    if transport == "shm":
        bucket = write_shm(bucket)
        body = BucketUpdateReq(path=str(bucket.path), meta=bucket.meta, weight_version=version, last=last)
        r = client.post(url, content=body.model_dump_json(), headers={"Content-Type": "application/json"})
    elif transport == "http":
        headers = {"Content-Type": "application/octet-stream", META_HEADER: bucket.meta.model_dump_json(),
                   "X-Weight-Version": version or "", "X-Last": "1" if last else "0"}
        r = client.post(url, content=bytes(to_bytes(bucket)), headers=headers)
    else:
        raise ValueError(f"unknown transport {transport!r}")
    r.raise_for_status()
    return r.json()
