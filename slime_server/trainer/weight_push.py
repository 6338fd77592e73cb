"""Trainer side of the bucketed weight push to engines speaking ``/update_weights_from_bucket``.

Why this shape: the trainer's gathered HF tensors are packed once into flat buckets (``weights.py``)
and every engine receives the same bucket (same-host: one shm file that all engines map; remote: the
bytes as an HTTP body). Staging a bucket does not touch the live weights, so buckets stream to all
engines concurrently while the next one is packed; only the *last* bucket makes an engine switch, and
with ``rolling`` those switches happen one engine after another, so the other engines keep serving
on a consistent version. Every engine's ``/get_weight_version`` is checked afterwards, and an engine
that fails is reported in a ``WeightPushError`` (which lists every engine's version), never skipped.

Only TP rank 0 of DP rank 0 sends; every other rank must still iterate its tensors, because the TP
all-gather inside ``convert.iter_hf_tensors`` is a collective.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, TypeVar

import httpx
import torch
from pydantic import BaseModel, Field

from slime_server.weights import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    SHM_DIR,
    Bucket,
    bucket_layout,
    fill_bucket,
    pack_buckets,
    push_bucket,
)

Transport = Literal["auto", "shm", "http"]
T = TypeVar("T")


class EnginePushStats(BaseModel):
    """What one engine took: bytes it received and the time spent in its update requests."""

    url: str
    seconds: float
    gbps: float
    weight_version: str | None = None


class PushStats(BaseModel):
    """Outcome of one push (on non-sender ranks only ``sent=False`` and the tensor count are meaningful)."""

    version: str
    sent: bool
    tensors: int = 0
    bytes: int = Field(0, description="payload bytes of the tensors (without bucket alignment padding)")
    buckets: int = 0
    pack_seconds: float = 0.0
    seconds: float = 0.0
    gbps: float = 0.0
    engines: list[EnginePushStats] = []


class WeightPushError(RuntimeError):
    """Some engines did not reach the new version; ``versions`` maps every engine URL to the version
    it reports now (None when it cannot be reached) and ``errors`` says what went wrong per engine."""

    def __init__(self, version: str, versions: dict[str, str | None], errors: dict[str, str]) -> None:
        self.version = version
        self.versions = versions
        self.errors = errors
        lines = [f"  {url}: version {versions.get(url)!r}; {err}" for url, err in errors.items()]
        ok = [u for u, v in versions.items() if v == version]
        super().__init__(f"weight push to version {version!r} failed on {len(errors)} engine(s):\n"
                         + "\n".join(lines) + f"\n  on the new version: {ok or 'none'}")


def is_push_sender() -> bool:
    """True on the one rank that talks to the engines: TP rank 0 of DP rank 0 (or a lone process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dist.get_rank() == 0
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("bucketed push with PP > 1 needs one commit across stages (not built yet)")
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class BucketArena:
    """Bucket buffers kept between pushes (shm files, or process memory for the http transport).

    Why: writing into freshly allocated pages costs ~6x a memcpy on Linux (one page fault per 4 KiB),
    which made packing the dominant cost of a push. Slot ``i`` holds bucket ``i`` of a push and is
    rewritten by the next push, which starts only after every engine has committed (engines drop
    their staged views at commit). Holds about one model's worth of memory while the pusher lives.
    """

    def __init__(self, shm_dir: str | None) -> None:
        self.shm_dir = shm_dir
        self._slots: list[tuple[torch.Tensor, str | None, mmap.mmap | None]] = []

    def buffer(self, index: int, nbytes: int) -> tuple[torch.Tensor, str | None, mmap.mmap | None]:
        """Slot ``index`` with at least ``nbytes`` (grown, and pre-faulted, when too small)."""
        if index < len(self._slots) and self._slots[index][0].numel() >= nbytes:
            return self._slots[index]
        slot = self._alloc(nbytes)
        slot[0].zero_()  # fault every page in now, once
        if index < len(self._slots):
            self._release(self._slots[index])
            self._slots[index] = slot
        else:
            self._slots.append(slot)
        return slot

    def _alloc(self, nbytes: int) -> tuple[torch.Tensor, str | None, mmap.mmap | None]:
        if self.shm_dir is None:
            return torch.empty(nbytes, dtype=torch.uint8), None, None
        fd, path = tempfile.mkstemp(prefix="slime-arena-", dir=self.shm_dir)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return torch.frombuffer(mm, dtype=torch.uint8), path, mm

    @staticmethod
    def _release(slot: tuple[torch.Tensor, str | None, mmap.mmap | None]) -> None:
        _, path, _mm = slot
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        # the mapping itself goes with the last tensor view of it (closing it under a view would fail)

    @property
    def nbytes(self) -> int:
        return sum(s[0].numel() for s in self._slots)

    def close(self) -> None:
        for slot in self._slots:
            self._release(slot)
        self._slots.clear()

    def pack(self, named: Iterable[tuple[str, torch.Tensor]], max_bytes: int,
             alignment: int = DEFAULT_ALIGNMENT) -> Iterator[Bucket]:
        """``weights.pack_buckets`` (same grouping, same layout) writing into this arena's slots."""
        group: list[tuple[str, torch.Tensor]] = []
        used = index = 0
        for name, t in named:
            size = _nbytes(t)
            if group and _align(used, alignment) + size > max_bytes:
                yield self._fill(index, group, alignment)
                group, used, index = [], 0, index + 1
            used = _align(used, alignment) + size
            group.append((name, t))
        if group:
            yield self._fill(index, group, alignment)

    def _fill(self, index: int, group: list[tuple[str, torch.Tensor]], alignment: int) -> Bucket:
        meta = bucket_layout(group, alignment)
        buf, path, mm = self.buffer(index, max(meta.total_bytes, 1))
        fill_bucket(buf, group, meta)
        return Bucket(meta=meta, buffer=buf[:meta.total_bytes], path=path, _keepalive=mm)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def mark_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Yield (item, is_last) with a lookahead of one: the last bucket is the one that commits."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


class WeightPusher:
    """Pushes named tensors to a fixed set of engines, bucket by bucket, and verifies the result.

    ``transport``: ``shm`` sends a file path (engines on this host), ``http`` sends the bytes, ``auto``
    picks shm for loopback URLs. ``sender=None`` decides from the Megatron ranks (``is_push_sender``).
    ``reuse_buffers`` keeps the bucket buffers between pushes (``BucketArena``: several times faster,
    at the cost of holding one model's worth of shm); without it each push allocates fresh buckets
    and holds at most three at a time.
    """

    def __init__(self, engine_urls: Sequence[str], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 transport: Transport = "auto", rolling: bool = True, *, timeout: float = 600.0,
                 sender: bool | None = None, reuse_buffers: bool = True) -> None:
        if not engine_urls:
            raise ValueError("WeightPusher needs at least one engine URL")
        if transport not in ("auto", "shm", "http"):
            raise ValueError(f"unknown transport {transport!r}")
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.bucket_bytes = bucket_bytes
        self.transport: Transport = transport
        self.rolling = rolling
        self.sender = sender
        self._client = httpx.Client(timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=len(self.engine_urls), thread_name_prefix="weight-push")
        use_shm = transport != "http" and os.access(SHM_DIR, os.W_OK)
        self._shm: bool | None = True if use_shm else None
        self._arena = BucketArena(SHM_DIR if use_shm else None) if reuse_buffers else None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
        if self._arena is not None:
            self._arena.close()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str) -> PushStats:
        """Send all tensors, switch every engine to ``version`` and verify it; raises WeightPushError."""
        ver = str(version)
        sender = is_push_sender() if self.sender is None else self.sender
        if not sender:
            n = sum(1 for _ in named_tensors)  # take part in the TP gathers, send nothing
            return PushStats(version=ver, sent=False, tensors=n)
        return self._push(named_tensors, ver)

    def versions(self) -> dict[str, str | None]:
        """Every engine's current ``weight_version`` (None when it does not answer)."""
        return {url: self._version(url) for url in self.engine_urls}

    # ------------------------------------------------------------------ internals
    def _version(self, url: str) -> str | None:
        try:
            r = self._client.get(f"{url}/get_weight_version", timeout=10)
            r.raise_for_status()
            return str(r.json()["weight_version"])
        except (httpx.HTTPError, KeyError, ValueError):
            return None

    def _send(self, url: str, bucket: Bucket, version: str, last: bool, spent: dict[str, float]) -> None:
        t0 = time.perf_counter()
        try:
            res = push_bucket(self._client, url, bucket, weight_version=version if last else None, last=last,
                              transport=self.transport)
        except httpx.HTTPStatusError as e:
            raise RuntimeError(f"HTTP {e.response.status_code}: {http_error_text(e.response)}") from None
        except httpx.HTTPError as e:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        finally:
            spent[url] += time.perf_counter() - t0
        if not res.get("success", False):
            raise RuntimeError(f"engine refused the bucket: {res.get('message')}")

    def _push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> PushStats:
        counted = _Counter(named)
        if self._arena is not None:
            buckets = self._arena.pack(counted, self.bucket_bytes)
        else:
            buckets = pack_buckets(counted, self.bucket_bytes, shm_dir=self._shm)
        spent = {u: 0.0 for u in self.engine_urls}
        errors: dict[str, str] = {}
        in_flight: list[tuple[str, Future[None]]] = []
        n_buckets, pack_s = 0, 0.0
        t_start = time.perf_counter()

        def settle() -> None:
            for url, fut in in_flight:
                exc = fut.exception()
                if exc is not None and url not in errors:
                    errors[url] = str(exc)
            in_flight.clear()

        it = mark_last(buckets)
        try:
            while True:
                t0 = time.perf_counter()
                item = next(it, None)  # packing happens here, overlapping the previous bucket's sends
                pack_s += time.perf_counter() - t0
                settle()  # at most one bucket in flight: bounded memory, and staging ends before commit
                if item is None:
                    break
                bucket, last = item
                n_buckets += 1
                live = [u for u in self.engine_urls if u not in errors]
                if not last:
                    in_flight += [(u, self._pool.submit(self._send, u, bucket, version, False, spent))
                                  for u in live]
                    continue
                for u in live:  # rolling: one engine switches at a time while the others keep serving
                    in_flight.append((u, self._pool.submit(self._send, u, bucket, version, True, spent)))
                    if self.rolling:
                        settle()
                settle()
        finally:
            for _, fut in in_flight:  # never leave a send running on a buffer the next push rewrites
                fut.exception()
        if n_buckets == 0:
            raise ValueError("nothing to push: the tensor iterator was empty")
        total_s = time.perf_counter() - t_start
        versions = self.versions()
        for url, v in versions.items():
            if v != version and url not in errors:
                errors[url] = f"reports weight_version {v!r} after the push"
        if errors:
            raise WeightPushError(version, versions, errors)
        gb = counted.bytes / 1e9
        engines = [EnginePushStats(url=u, seconds=spent[u], gbps=gb / spent[u] if spent[u] else 0.0,
                                   weight_version=versions[u]) for u in self.engine_urls]
        return PushStats(version=version, sent=True, tensors=counted.count, bytes=counted.bytes,
                         buckets=n_buckets, pack_seconds=pack_s, seconds=total_s,
                         gbps=gb / total_s if total_s else 0.0, engines=engines)


class _Counter:
    """Pass-through iterator that counts tensors and their payload bytes."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._it = iter(named)
        self.count = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._it:
            self.count += 1
            self.bytes += _nbytes(t)
            yield name, t


def http_error_text(response: httpx.Response) -> str:
    """The message of an engine's error body (SGLang / OpenAI / UpdateWeightsResult shapes)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:300]
