"""Weight sync into real SGLang servers (GPU deployments), over SGLang's own update endpoints.

Two paths, as in slime:
- ``SGLangDistributedSync`` (decoupled engines): the trainer's rank 0 and every engine GPU form one
  process group (``/init_weights_update_group``); per bucket the trainer posts
  ``/update_weights_from_distributed`` (names, dtypes, shapes) to every engine and, while those
  requests wait, broadcasts each tensor from rank 0. The last bucket carries ``weight_version`` and
  ``flush_cache``.
- ``SGLangTensorSync`` (colocated engines): tensors are serialised with torch's multiprocessing
  reductions (CUDA IPC handles on GPU) and posted to ``/update_weights_from_tensor``.

Both pause generation (``/pause_generation``), flush the cache, update, then ``/continue_generation``,
and verify ``/get_weight_version``. torch.distributed / NCCL bits are imported lazily: this module
imports on a CPU-only machine, where the request bodies are tested against a recording HTTP server.
The broadcast itself goes through a ``Broadcaster`` (NCCL on GPU, gloo for CPU tests).
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Literal, Protocol

import httpx
import torch
from pydantic import BaseModel

from slime_server.trainer.weight_push import (
    EnginePushStats,
    PushStats,
    WeightPushError,
    http_error_text,
    mark_last,
)
from slime_server.weights import DEFAULT_BUCKET_BYTES, dtype_name

PauseMode = Literal["abort", "retract", "in_place"]


# ---------------------------------------------------------------- SGLang request bodies


class InitWeightsUpdateGroupReq(BaseModel):
    """Body of SGLang's ``POST /init_weights_update_group``; engine rank = rank_offset + its TP rank."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReq(BaseModel):
    """Body of SGLang's ``POST /update_weights_from_distributed`` (one bucket of broadcast tensors)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromTensorReq(BaseModel):
    """Body of SGLang's ``POST /update_weights_from_tensor``: one serialised payload per engine TP rank."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class PauseGenerationReq(BaseModel):
    mode: PauseMode = "retract"


# ---------------------------------------------------------------- helpers


def group_by_bytes(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most ``max_bytes`` in total (a larger tensor goes alone)."""
    group: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, t in named:
        size = t.numel() * t.element_size()
        if group and used + size > max_bytes:
            yield group
            group, used = [], 0
        group.append((name, t))
        used += size
    if group:
        yield group


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` format: base64 of a
    ForkingPickler dump, so CUDA tensors travel as IPC handles (CPU ones as shared memory)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``serialize_named_tensors`` (what an SGLang TP worker does)."""
    import pickle

    import torch.multiprocessing  # noqa: F401

    return pickle.loads(base64.b64decode(data))


class Broadcaster(Protocol):
    """Rank 0's side of the weight-update group."""

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class GroupBroadcaster:
    """Rank 0 of a standalone process group that SGLang's ``init_custom_process_group`` can join.

    Built without touching the default process group (the trainer already has one): a TCPStore
    at ``master_address:master_port`` with the same key prefixes torch's ``_new_process_group_helper``
    uses (``{group_name}/{device}/``), then the backend object (NCCL on GPU, gloo on CPU) directly.
    """

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str,
                 backend: str = "nccl", timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, True, timeout=timeout)
        device = "cuda" if backend == "nccl" else "cpu"
        prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", store))
        if backend == "nccl":
            self._pg: Any = dist.ProcessGroupNCCL(prefixed, 0, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, 0, world_size, timeout)
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"unsupported backend {backend!r}")
        self._store = store

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        t = tensor.detach().to(self.device).contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([t], opts).wait()

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if callable(shutdown):
            shutdown()


# ---------------------------------------------------------------- common HTTP driving


class _SGLangEngines:
    """Shared HTTP plumbing: posting to all engines, pause/flush/continue, version checks."""

    def __init__(self, engine_urls: Sequence[str], timeout: float) -> None:
        if not engine_urls:
            raise ValueError("need at least one engine URL")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self._client = httpx.Client(timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self.engine_urls), thread_name_prefix="sglang-sync")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def _post(self, url: str, path: str, body: BaseModel | None = None) -> dict[str, Any]:
        content = body.model_dump_json() if body is not None else "{}"
        r = self._client.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"})
        if r.status_code >= 400:
            raise RuntimeError(f"{path} -> HTTP {r.status_code}: {http_error_text(r)}")
        try:
            data = r.json()
        except ValueError:
            return {}
        if isinstance(data, dict) and data.get("success") is False:
            raise RuntimeError(f"{path} failed: {data.get('message')}")
        return data if isinstance(data, dict) else {}

    def _post_all_async(self, path: str, bodies: Sequence[BaseModel | None]) -> list[Future[dict[str, Any]]]:
        return [self._pool.submit(self._post, u, path, b) for u, b in zip(self.engine_urls, bodies, strict=True)]

    def _post_all(self, path: str, body: BaseModel | None = None) -> None:
        errors = _collect(self.engine_urls, self._post_all_async(path, [body] * len(self.engine_urls)))
        if errors:
            raise RuntimeError("; ".join(f"{u}: {e}" for u, e in errors.items()))

    def versions(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for u in self.engine_urls:
            try:
                r = self._client.get(f"{u}/get_weight_version", timeout=10)
                r.raise_for_status()
                out[u] = str(r.json()["weight_version"])
            except (httpx.HTTPError, KeyError, ValueError):
                out[u] = None
        return out

    def _finish(self, version: str, errors: dict[str, str], nbytes: int, ntensors: int, nbuckets: int,
                t0: float) -> PushStats:
        versions = self.versions()
        for u, v in versions.items():
            if v != version and u not in errors:
                errors[u] = f"reports weight_version {v!r} after the update"
        if errors:
            raise WeightPushError(version, versions, errors)
        secs = time.perf_counter() - t0
        gbps = nbytes / 1e9 / secs if secs else 0.0
        return PushStats(version=version, sent=True, tensors=ntensors, bytes=nbytes, buckets=nbuckets,
                         seconds=secs, gbps=gbps,
                         engines=[EnginePushStats(url=u, seconds=secs, gbps=gbps, weight_version=versions[u])
                                  for u in self.engine_urls])

    def _paused(self, pause_mode: PauseMode) -> _PauseScope:
        return _PauseScope(self, pause_mode)


class _PauseScope:
    """pause_generation + flush_cache on entry, continue_generation on exit (even after errors)."""

    def __init__(self, engines: _SGLangEngines, mode: PauseMode) -> None:
        self.engines, self.mode = engines, mode

    def __enter__(self) -> None:
        self.engines._post_all("/pause_generation", PauseGenerationReq(mode=self.mode))
        if self.mode != "in_place":  # in-place pause keeps KV state that a flush would free
            self.engines._post_all("/flush_cache")

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            self.engines._post_all("/continue_generation")
        except RuntimeError:
            if exc_type is None:  # do not hide the error that ended the update
                raise


def _collect(urls: Sequence[str], futures: Sequence[Future[Any]]) -> dict[str, str]:
    errors: dict[str, str] = {}
    for u, f in zip(urls, futures, strict=True):
        exc = f.exception()
        if exc is not None:
            errors[u] = str(exc)
    return errors


# ---------------------------------------------------------------- the two sync paths


class SGLangDistributedSync(_SGLangEngines):
    """Broadcast weights from the trainer's rank 0 into decoupled SGLang engines.

    ``engine_gpus[i]`` is engine i's number of GPUs (its TP size): the group has world size
    ``1 + sum(engine_gpus)`` and engine i's ranks start at ``1 + sum(engine_gpus[:i])``. All engines
    share one group, so they update together (no rolling), and an engine that refuses a bucket
    before receiving it leaves the broadcast waiting until the group's timeout, as in slime.
    """

    def __init__(self, engine_urls: Sequence[str], engine_gpus: Sequence[int] | int = 1, *,
                 master_address: str = "127.0.0.1", master_port: int | None = None,
                 group_name: str = "slime_weight_update", backend: str = "nccl",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, pause_mode: PauseMode = "retract",
                 timeout: float = 600.0) -> None:
        super().__init__(engine_urls, timeout)
        gpus = [engine_gpus] * len(self.engine_urls) if isinstance(engine_gpus, int) else list(engine_gpus)
        if len(gpus) != len(self.engine_urls) or min(gpus) < 1:
            raise ValueError("engine_gpus needs one positive entry per engine")
        self.engine_gpus = gpus
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.timeout = timeout
        self._broadcaster: Broadcaster | None = None

    @property
    def world_size(self) -> int:
        return 1 + sum(self.engine_gpus)

    def init_requests(self) -> list[InitWeightsUpdateGroupReq]:
        """The ``/init_weights_update_group`` body for each engine (rank offsets after rank 0)."""
        if self.master_port is None:
            from slime_server.utils.net import find_free_port

            self.master_port = find_free_port(self.master_address)
        offsets = [1 + sum(self.engine_gpus[:i]) for i in range(len(self.engine_gpus))]
        return [InitWeightsUpdateGroupReq(master_address=self.master_address, master_port=self.master_port,
                                          rank_offset=off, world_size=self.world_size,
                                          group_name=self.group_name, backend=self.backend)
                for off in offsets]

    def connect(self) -> None:
        """Form the group: engines join through HTTP while this process creates rank 0."""
        bodies = self.init_requests()
        futures = self._post_all_async("/init_weights_update_group", bodies)
        try:
            assert self.master_port is not None
            self._broadcaster = GroupBroadcaster(self.master_address, self.master_port, self.world_size,
                                                 self.group_name, self.backend, self.timeout)
        finally:
            errors = _collect(self.engine_urls, futures)
        if errors:
            raise RuntimeError(f"engines failed to join the weight-update group: {errors}")

    def close(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None
        super().close()

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str) -> PushStats:
        """Pause, broadcast bucket by bucket (version on the last), continue, verify."""
        if self._broadcaster is None:
            raise RuntimeError("call connect() before push()")
        ver, t0 = str(version), time.perf_counter()
        nbytes = ntensors = nbuckets = 0
        errors: dict[str, str] = {}
        with self._paused(self.pause_mode):
            for group, last in mark_last(group_by_bytes(named_tensors, self.bucket_bytes)):
                body = UpdateWeightsFromDistributedReq(
                    names=[n for n, _ in group], dtypes=[dtype_name(t.dtype) for _, t in group],
                    shapes=[list(t.shape) for _, t in group], group_name=self.group_name,
                    flush_cache=last, weight_version=ver if last else None)
                futures = self._post_all_async("/update_weights_from_distributed", [body] * len(self.engine_urls))
                for _, t in group:  # the engines' requests block until they have received every tensor
                    self._broadcaster.broadcast(t)
                errors.update(_collect(self.engine_urls, futures))
                nbuckets += 1
                ntensors += len(group)
                nbytes += sum(t.numel() * t.element_size() for _, t in group)
                if errors:  # a broken collective cannot go on: the group's members are out of step
                    break
        return self._finish(ver, errors, nbytes, ntensors, nbuckets, t0)


class SGLangTensorSync(_SGLangEngines):
    """Hand tensors to colocated SGLang engines by reference (``/update_weights_from_tensor``).

    Each engine gets ``engine_tp`` payloads, one per TP rank, all serialised by this process (right
    when the engine shares this GPU; colocated multi-GPU engines need one payload per GPU, gathered
    from the trainer rank on that GPU, which ``request_for(serialized_per_rank=...)`` accepts).
    """

    def __init__(self, engine_urls: Sequence[str], engine_tp: int = 1, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 load_format: str | None = None, pause_mode: PauseMode = "retract", timeout: float = 600.0) -> None:
        super().__init__(engine_urls, timeout)
        if engine_tp < 1:
            raise ValueError("engine_tp must be >= 1")
        self.engine_tp = engine_tp
        self.bucket_bytes = bucket_bytes
        self.load_format = load_format
        self.pause_mode = pause_mode

    def request_for(self, group: list[tuple[str, torch.Tensor]], last: bool, version: str,
                    serialized_per_rank: list[str] | None = None) -> UpdateWeightsFromTensorReq:
        """One engine's body. Each TP rank gets its own payload: a CPU payload passes file descriptors
        that can be taken only once, so payloads are never shared between ranks or engines."""
        payloads = serialized_per_rank or [serialize_named_tensors(group) for _ in range(self.engine_tp)]
        return UpdateWeightsFromTensorReq(serialized_named_tensors=payloads, load_format=self.load_format,
                                          flush_cache=last, weight_version=version if last else None)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str) -> PushStats:
        """Pause, post each bucket (tensors stay alive until every engine answered), continue, verify."""
        ver, t0 = str(version), time.perf_counter()
        nbytes = ntensors = nbuckets = 0
        errors: dict[str, str] = {}
        with self._paused(self.pause_mode):
            for group, last in mark_last(group_by_bytes(named_tensors, self.bucket_bytes)):
                bodies = [self.request_for(group, last, ver) for _ in self.engine_urls]
                futures = self._post_all_async("/update_weights_from_tensor", bodies)
                errors.update(_collect(self.engine_urls, futures))
                nbuckets += 1
                ntensors += len(group)
                nbytes += sum(t.numel() * t.element_size() for _, t in group)
                if errors:
                    break
        return self._finish(ver, errors, nbytes, ntensors, nbuckets, t0)
