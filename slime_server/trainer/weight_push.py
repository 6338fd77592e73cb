"""Trainer side of the bucketed weight push, through SGLang's own weight-update API only.

One pusher, two transports, chosen by where the engines are (``mode="auto"``):
- **tensor** (engines on this host, e.g. colocated): each bucket is packed once into a reusable shared
  buffer (``weights.SharedArena``: shared memory on CPU, device memory on GPU) and handed over by
  reference with ``/update_weights_from_tensor`` (``load_format="flattened_bucket"``; one payload per
  engine TP rank: CUDA IPC handles on GPU, shared-memory file names on CPU). CPU tensors that already
  live in shared memory (a sender rank's parameters: ``weights.share_in_place``) are not packed: they go
  in buckets of their own as (name, tensor) pairs (SGLang's default format), by file name and offset, and
  the engine copies straight from them; they must not change until ``push`` returns (a rank trains only
  after its push). Engines are updated one after another (``rolling``): while one is paused the others
  keep serving.
- **distributed** (engines elsewhere): the trainer's rank 0 and every engine rank form one process
  group (``/init_weights_update_group``, SGLang's rendezvous; NCCL on GPU, gloo on CPU); per bucket
  every engine gets ``/update_weights_from_distributed`` and rank 0 broadcasts ONE flat tensor. All
  engines are in the collective, so they update together. The group is kept between pushes and
  rebuilt after a failure or when the engine set changes (``destroy_weights_update_group`` first).

Either way, as slime drives SGLang: ``/pause_generation`` (``retract`` by default: running requests go
back to the queue and are recomputed on the new weights, so no request fails and no token mixes
weights), the buckets (``weight_version`` and ``flush_cache`` on the last one), ``/continue_generation``
(also after errors), then every engine's version is read back from ``/model_info``; an engine that did
not reach it is reported in a ``WeightPushError``, never skipped.

Only TP rank 0 of DP rank 0 sends; every other rank still iterates its tensors, because the TP
all-gather inside ``convert.iter_hf_tensors`` is a collective.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Literal, TypeVar

import httpx
import torch
from pydantic import BaseModel, Field

from slime_server.rollout.engine_auth import auth_headers
from slime_server.rollout.engine_info import engine_tp_size, engine_weight_version
from slime_server.rollout.protocol import (
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    PauseMode,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from slime_server.utils.net import address_towards, engine_limits, is_local_host
from slime_server.weights import (
    DEFAULT_BUCKET_BYTES,
    FLATTENED_BUCKET,
    ByteGrouper,
    FlatMeta,
    SharedArena,
    close_weight_group,
    dtype_name,
    fill_flat,
    flat_size,
    flattened_payload,
    host_weight_rendezvous,
    layout_of,
    nbytes,
    open_weight_group,
    serialize,
)

SyncMode = Literal["auto", "tensor", "distributed"]
T = TypeVar("T")
GROUP_TIMEOUT_S = 120.0


class EnginePushStats(BaseModel):
    """What one engine took: the time spent in its update requests."""

    url: str
    seconds: float
    gbps: float
    weight_version: str | None = None


class PushStats(BaseModel):
    """Outcome of one push (on non-sender ranks only ``sent=False`` and the tensor count are meaningful)."""

    version: str
    sent: bool
    mode: str = ""
    tensors: int = 0
    bytes: int = Field(0, description="payload bytes of the tensors")
    buckets: int = 0
    referenced_bytes: int = Field(0, description="bytes the engines copied straight from tensors already in "
                                  "shared memory (tensor path), not packed into a bucket first")
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
    """True on the one rank that talks to the engines: TP rank 0 of DP rank 0 of the first pipeline stage (or a
    lone process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dist.get_rank() == 0
    # with PP > 1 the later stages stream their tensors to the first (trainer/pipeline.py: pipeline_hf_tensors)
    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == 0)


def mark_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Yield (item, is_last) with a lookahead of one: the last bucket carries the version."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def http_error_text(response: httpx.Response) -> str:
    """The message of an engine's error body (SGLang / OpenAI / ``{"success", "message"}`` shapes)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "error_message"):  # weight updates / LoRA updates
            if body.get(key):
                return str(body[key])
    return str(body)[:300]


class _Bucket:
    """One bucket: packed (its flat buffer and layout), or (``named``) tensors that already live in shared
    memory, handed over in place; and (tensor path) the payload sent for it."""

    def __init__(self, flat: torch.Tensor | None, metas: list[FlatMeta],
                 named: list[tuple[str, torch.Tensor]] | None = None) -> None:
        self.flat, self.metas, self.named = flat, metas, named
        self.payload: str | None = None

    @property
    def nbytes(self) -> int:
        return flat_size(self.metas) if self.named is None else sum(nbytes(t) for _, t in self.named)


def in_shared_memory(t: torch.Tensor) -> bool:
    """A CPU tensor whose storage is a shared-memory file already: it pickles as the file's name, no copy."""
    return t.device.type == "cpu" and t.is_shared()


class WeightPusher:
    """Pushes named HF tensors to a fixed set of engines, bucket by bucket, and verifies the result.

    ``mode``: ``tensor`` (same host), ``distributed`` (a process group), or ``auto`` (tensor when every
    engine is on this host). ``engine_tp[i]``: engine i's TP size (payloads per engine on the tensor path,
    ranks in the group on the distributed path); None reads each engine's ``tp_size`` from its ``/server_info``
    at the first push (an SGLang engine started with ``--tp-size 2`` indexes ``serialized_named_tensors`` by its
    TP rank and joins a group with two ranks). ``sender=None`` decides from the Megatron ranks.
    """

    def __init__(self, engine_urls: Sequence[str], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 mode: SyncMode = "auto", rolling: bool = True, *, timeout: float = 600.0,
                 sender: bool | None = None, pause_mode: PauseMode = "retract",
                 engine_tp: Sequence[int] | int | None = None, master_address: str | None = None,
                 backend: str | None = None, api_key: str | None = None) -> None:
        if not engine_urls:
            raise ValueError("WeightPusher needs at least one engine URL")
        if mode not in ("auto", "tensor", "distributed"):
            raise ValueError(f"unknown weight sync mode {mode!r}")
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        tps = None if engine_tp is None else [engine_tp] * len(self.engine_urls) if isinstance(engine_tp, int) \
            else list(engine_tp)
        if tps is not None and (len(tps) != len(self.engine_urls) or min(tps) < 1):
            raise ValueError("engine_tp needs one positive entry per engine")
        self._engine_tp = tps
        self._tp_now: list[int] = tps or [1] * len(self.engine_urls)
        self.bucket_bytes = bucket_bytes
        hosts = [httpx.URL(u).host for u in self.engine_urls]
        self.mode: SyncMode = mode if mode != "auto" else (
            "tensor" if all(is_local_host(h) for h in hosts) else "distributed")
        self.rolling = rolling
        self.sender = sender
        self.pause_mode: PauseMode = pause_mode
        self.master_address = master_address or address_towards(hosts[0])
        self.backend = backend
        self._client = httpx.Client(timeout=timeout, headers=auth_headers(api_key),  # SGLang's --api-key
                                    limits=engine_limits())
        self._pool = ThreadPoolExecutor(max_workers=len(self.engine_urls) + 1, thread_name_prefix="weight-push")
        self._arena = SharedArena(shared=True)
        self._pack_s, self._ref_bytes = 0.0, 0
        self._group: Any = None
        self._group_name = ""
        self.rendezvous_port: int | None = None  # the last group's (closed once it formed)

    @property
    def engine_tp(self) -> list[int]:
        """Every engine's TP size, read from the engines once (an engine that does not say counts as 1 and is
        asked again at the next push)."""
        if self._engine_tp is None:
            read = [engine_tp_size(self._client, u, timeout=10) for u in self.engine_urls]
            if all(tp is not None for tp in read):
                self._engine_tp = [int(tp) for tp in read if tp is not None]
            return [tp or 1 for tp in read]
        return self._engine_tp

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._disconnect()
        self._pool.shutdown(wait=True)
        self._client.close()
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
        counted = _Counter(named_tensors)
        self._tp_now = self.engine_tp  # read once per push at most
        spent = {u: 0.0 for u in self.engine_urls}
        errors: dict[str, str] = {}
        t0 = time.perf_counter()
        buckets = self._pack(counted)
        if self.mode == "tensor":
            n_buckets = self._push_tensor(buckets, ver, spent, errors)
        else:
            n_buckets = self._push_distributed(buckets, ver, spent, errors)
        total_s = time.perf_counter() - t0
        if n_buckets == 0:
            raise ValueError("nothing to push: the tensor iterator was empty")
        versions = self.versions()
        for url, v in versions.items():
            if v != ver and url not in errors:
                errors[url] = f"reports weight_version {v!r} after the push"
        if errors:
            raise WeightPushError(ver, versions, errors)
        gb = counted.bytes / 1e9
        engines = [EnginePushStats(url=u, seconds=spent[u], gbps=gb / spent[u] if spent[u] else 0.0,
                                   weight_version=versions[u]) for u in self.engine_urls]
        return PushStats(version=ver, sent=True, mode=self.mode, tensors=counted.count, bytes=counted.bytes,
                         buckets=n_buckets, referenced_bytes=self._ref_bytes, pack_seconds=self._pack_s,
                         seconds=total_s,
                         gbps=gb / total_s if total_s else 0.0, engines=engines)

    def versions(self) -> dict[str, str | None]:
        """Every engine's current ``weight_version`` (None when it does not answer)."""
        return {url: engine_weight_version(self._client, url, timeout=10) for url in self.engine_urls}

    # ------------------------------------------------------------------ packing
    def _pack(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[_Bucket]:
        """Buckets of at most ``bucket_bytes``, lazily. On the tensor path, tensors already in shared memory (a
        trainer's parameters, ``weights.share_in_place``) go in buckets of their own, by reference: the engine
        copies straight from them, the push's only copy. Every other tensor is packed into the arena (one copy
        per tensor), as the broadcast path packs everything."""
        self._pack_s, self._ref_bytes = 0.0, 0
        by_ref = self.mode == "tensor"
        packed, referenced = ByteGrouper(self.bucket_bytes), ByteGrouper(self.bucket_bytes, aligned=False)
        index = 0
        it = iter(named)
        while True:
            t0 = time.perf_counter()
            item = next(it, None)
            if item is None:
                # the tensors in place first: packing the rest overlaps the engine's copy of them
                ready = [(referenced.flush(), True), (packed.flush(), False)]
            else:
                ref = by_ref and in_shared_memory(item[1])
                ready = [((referenced if ref else packed).add(*item), ref)]
            for group, ref in ready:
                if group is None:
                    continue
                if ref:
                    self._ref_bytes += sum(nbytes(t) for _, t in group)
                    bucket = _Bucket(None, [], named=[(n, t.detach()) for n, t in group])  # no flat layout
                else:
                    bucket = self._packed(group, index)
                    index += 1
                self._pack_s += time.perf_counter() - t0
                yield bucket
                t0 = time.perf_counter()
            self._pack_s += time.perf_counter() - t0
            if item is None:
                return

    def _packed(self, group: list[tuple[str, torch.Tensor]], index: int) -> _Bucket:
        metas = layout_of(group)
        device = group[0][1].device
        if device.type == "cpu":
            flat = self._arena.buffer(index, flat_size(metas))
        else:  # GPU: a device buffer (IPC handle / NCCL broadcast source)
            flat = torch.empty(flat_size(metas), dtype=torch.uint8, device=device)
        fill_flat(flat, group, metas)
        return _Bucket(flat, metas)

    # ------------------------------------------------------------------ HTTP
    def _post(self, url: str, path: str, body: BaseModel | None, spent: dict[str, float] | None = None) -> None:
        t0 = time.perf_counter()
        try:
            content = body.model_dump_json(exclude_none=True) if body is not None else "{}"
            r = self._client.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            raise RuntimeError(f"{path}: {type(e).__name__}: {e}") from None
        finally:
            if spent is not None:
                spent[url] += time.perf_counter() - t0
        if r.status_code >= 400:
            raise RuntimeError(f"{path} -> HTTP {r.status_code}: {http_error_text(r)}")
        try:
            data = r.json()
        except ValueError:
            return
        if isinstance(data, dict) and data.get("success") is False:
            raise RuntimeError(f"{path} failed: {data.get('message') or data.get('error_message')}")

    def _on_all(self, urls: Sequence[str], fn: Callable[[str], None], errors: dict[str, str]) -> None:
        futures = [(u, self._pool.submit(fn, u)) for u in urls]
        _settle(futures, errors)

    def _pause(self, urls: Sequence[str], errors: dict[str, str]) -> None:
        self._on_all(urls, lambda u: self._post(u, "/pause_generation", PauseGenerationReqInput(mode=self.pause_mode)),
                     errors)

    def _continue(self, urls: Sequence[str], errors: dict[str, str]) -> None:
        cont: dict[str, str] = {}
        self._on_all(urls, lambda u: self._post(u, "/continue_generation", ContinueGenerationReqInput()), cont)
        for u, e in cont.items():  # a failed continue must not hide the error that ended the update
            errors.setdefault(u, e)

    @property
    def _flush_last(self) -> bool:
        return self.pause_mode != "in_place"  # in place keeps running requests: SGLang refuses the flush

    # ------------------------------------------------------------------ tensor path
    def _tensor_req(self, b: _Bucket, url: str, last: bool, version: str) -> UpdateWeightsFromTensorReqInput:
        tp = self._tp_now[self.engine_urls.index(url)]
        if b.named is not None:  # tensors in shared memory, by name and offset: SGLang's default format
            if b.payload is None:
                b.payload = serialize(b.named)
            return UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b.payload] * tp, load_format=None,
                                                   flush_cache=last and self._flush_last,
                                                   weight_version=version if last else None)
        assert b.flat is not None
        if b.flat.device.type == "cpu":
            if b.payload is None:  # serialised once: a CPU payload names a shared file and can be read many times
                b.payload = serialize(flattened_payload(b.flat, b.metas))
            payloads = [b.payload] * tp
        else:  # CUDA IPC: one payload per engine TP rank, and only what is sent. Every share of a CUDA tensor adds
            # one to its cross-process reference count, which the receiver gives back once per payload; a share
            # never sent would hold the bucket in torch's IPC limbo for good (measured: one model per push).
            payloads = [serialize(flattened_payload(b.flat, b.metas)) for _ in range(tp)]
        return UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=FLATTENED_BUCKET,
                                               flush_cache=last and self._flush_last,
                                               weight_version=version if last else None)

    def _send_tensor(self, url: str, b: _Bucket, last: bool, version: str, spent: dict[str, float]) -> None:
        self._post(url, "/update_weights_from_tensor", self._tensor_req(b, url, last, version), spent)
        if b.flat is not None and b.flat.is_cuda:
            torch.cuda.ipc_collect()  # release the IPC handles the engine has closed

    def _push_tensor(self, buckets: Iterator[_Bucket], version: str, spent: dict[str, float],
                     errors: dict[str, str]) -> int:
        # Rolling keeps every bucket of this push for the engines after the first (CPU: the arena's slots,
        # which it holds anyway; GPU: one model's worth of device memory until the push ends).
        rolling = self.rolling and len(self.engine_urls) > 1
        first = [self.engine_urls[0]] if rolling else list(self.engine_urls)
        kept: list[_Bucket] = []
        n = self._update_tensor(first, mark_last(buckets), version, spent, errors, keep=kept if rolling else None)
        for url in self.engine_urls[1:] if rolling else []:  # the others, one at a time, same buckets
            self._update_tensor([url], mark_last(kept), version, spent, errors, keep=None)
        return n

    def _update_tensor(self, urls: list[str], buckets: Iterator[tuple[_Bucket, bool]], version: str,
                       spent: dict[str, float], errors: dict[str, str], keep: list[_Bucket] | None) -> int:
        live = [u for u in urls if u not in errors]
        self._pause(live, errors)
        n = 0
        in_flight: list[tuple[str, Future[Any]]] = []
        try:
            for b, last in buckets:  # taking the next item packs the bucket after it: overlaps the send
                _settle(in_flight, errors)  # one bucket in flight: the last one (the version) lands last
                n += 1
                if keep is not None:
                    keep.append(b)
                live = [u for u in live if u not in errors]
                in_flight = [(u, self._pool.submit(self._send_tensor, u, b, last, version, spent)) for u in live]
        finally:
            _settle(in_flight, errors)
            self._continue(list(urls), errors)
        return n

    # ------------------------------------------------------------------ distributed path
    def _connect(self) -> None:
        """Form the group: every engine joins over HTTP while this process opens rank 0."""
        self._group_name = f"slime-{uuid.uuid4().hex[:12]}"
        tps = self._tp_now
        world = 1 + sum(tps)
        # The rendezvous listens before its port is announced (port 0: the OS picks one, no other process can take
        # it in between); it is open only while the group forms: its server is dropped below, joined or not.
        server = host_weight_rendezvous(self.master_address, 0, world, GROUP_TIMEOUT_S)
        port = int(server.port)
        offsets = [1 + sum(tps[:i]) for i in range(len(self.engine_urls))]
        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        bodies = {u: InitWeightsUpdateGroupReqInput(master_address=self.master_address, master_port=port,
                                                    rank_offset=off, world_size=world, group_name=self._group_name,
                                                    backend=backend)
                  for u, off in zip(self.engine_urls, offsets, strict=True)}
        futures = [(u, self._pool.submit(self._post, u, "/init_weights_update_group", bodies[u]))
                   for u in self.engine_urls]
        # Rank 0 joins on a thread of its own: when an engine refuses to join (a wrong key, a bad request)
        # we give up at once instead of waiting out GROUP_TIMEOUT_S; members still in the rendezvous then
        # find its server gone and give up at their own timeout.
        rendezvous: Future[Any] = Future()

        def open_rank0() -> None:
            try:
                rendezvous.set_result(open_weight_group(self.master_address, port, world, 0, self._group_name,
                                                        backend, GROUP_TIMEOUT_S, hosted=True))
            except BaseException as e:  # noqa: BLE001  (any rendezvous failure: reported below)
                rendezvous.set_exception(e)

        threading.Thread(target=open_rank0, name="weight-group-rank0", daemon=True).start()
        pending: set[Future[Any]] = {f for _, f in futures} | {rendezvous}
        while pending and not any(f.done() and f.exception() is not None for _, f in futures):
            _, pending = wait(pending, return_when=FIRST_COMPLETED)
        del server  # every member is in the mesh (or we gave up): the port closes now
        self.rendezvous_port = port
        errors: dict[str, str] = {}
        _settle([(u, f) for u, f in futures if f.done()], errors)
        if rendezvous.done():
            if rendezvous.exception() is not None:
                errors["rank 0"] = f"{type(rendezvous.exception()).__name__}: {rendezvous.exception()}"
            else:
                self._group = rendezvous.result()
        if errors:
            for u, f in futures:  # still joining: they time out with the abandoned rendezvous, unawaited
                if not f.done():
                    errors.setdefault(u, "abandoned: another member could not join")
            self._disconnect()
            raise RuntimeError(f"engines could not form the weight-update group: {errors}")

    def _disconnect(self) -> None:
        if self._group is None:
            return
        body = DestroyWeightsUpdateGroupReqInput(group_name=self._group_name)
        futures = [(u, self._pool.submit(self._post, u, "/destroy_weights_update_group", body))
                   for u in self.engine_urls]
        close_weight_group(self._group)
        self._group = None
        _settle(futures, {})  # an engine that restarted has no such group: nothing to undo there

    def _push_distributed(self, buckets: Iterator[_Bucket], version: str, spent: dict[str, float],
                          errors: dict[str, str]) -> int:
        import torch.distributed as dist

        if self._group is None:
            try:
                self._connect()
            except RuntimeError as e:
                errors.update({u: str(e) for u in self.engine_urls})
                return 1
        self._pause(self.engine_urls, errors)
        n = 0
        try:
            for b, last in mark_last(buckets):
                n += 1
                if errors:
                    continue  # drain the iterator: the other trainer ranks are in its TP gathers
                body = UpdateWeightsFromDistributedReqInput(
                    names=[m.name for m in b.metas], dtypes=[dtype_name(m.dtype) for m in b.metas],
                    shapes=[list(m.shape) for m in b.metas], group_name=self._group_name,
                    flush_cache=last and self._flush_last, weight_version=version if last else None,
                    load_format=FLATTENED_BUCKET)
                futures = [(u, self._pool.submit(self._post, u, "/update_weights_from_distributed", body, spent))
                           for u in self.engine_urls]
                try:  # the engines' requests block until they have received the broadcast
                    dist.broadcast(b.flat, src=0, group=self._group)
                except Exception as e:  # noqa: BLE001  (a broken collective: every engine is out of step)
                    errors.update({u: f"broadcast failed: {e}" for u in self.engine_urls})
                _settle(futures, errors)
        finally:
            if errors:
                self._disconnect()  # a failed collective leaves the members out of step: rebuild next time
            self._continue(self.engine_urls, errors)
        return n


def _settle(futures: Sequence[tuple[str, Future[Any]]], errors: dict[str, str]) -> None:
    for url, fut in futures:
        exc = fut.exception()
        if exc is not None and url not in errors:
            errors[url] = str(exc)


class _Counter:
    """Pass-through iterator that counts tensors and their payload bytes."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._it = iter(named)
        self.count = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._it:
            self.count += 1
            self.bytes += nbytes(t)
            yield name, t
