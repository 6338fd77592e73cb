"""Weight-update payloads in SGLang's own formats, shared by the trainer (sender) and the CPU engine.

Why SGLang's formats and nothing of our own: a real SGLang server must take our pushes unchanged, and
the CPU engine must accept exactly what SGLang accepts, so CI exercises the GPU code path.

- **Flattened bucket** (SGLang's ``FlattenedTensorBucket``, ``load_format="flattened_bucket"``): the
  tensors of a bucket laid end to end as one uint8 tensor, each described by
  ``name, shape, dtype, start_idx, end_idx, numel`` (byte offsets, no padding). Used by both paths: on
  ``/update_weights_from_distributed`` the engine computes the same layout from names/dtypes/shapes and
  receives ONE broadcast per bucket; on ``/update_weights_from_tensor`` the layout travels in the payload.
- **Payload** of ``/update_weights_from_tensor``: SGLang's ``MultiprocessingSerializer`` format (base64
  of a ``ForkingPickler`` dump), so a CUDA tensor travels as an IPC handle and a CPU tensor as the name
  of a shared-memory file (torch's ``file_system`` sharing strategy). The metadata entries are
  ``types.SimpleNamespace`` objects: SGLang reads them by attribute, and its ``SafeUnpickler`` allows
  them without importing SGLang on the sender. Receivers unpickle with an allow-list (``load_payload``).
- **Process group** for ``/init_weights_update_group``: SGLang's ``init_custom_process_group`` scheme (a
  TCP rendezvous at rank 0, the store wrapped in ``PrefixStore(group_name, ...)``, then torch's own
  per-group prefixes), so the trainer's rank 0 and SGLang's ranks meet (``open_weight_group``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import pickle
import threading
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from slime_server.utils.net import address_towards, interface_of

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's --update-weight-buffer-size default
FLATTENED_BUCKET = "flattened_bucket"

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}


def dtype_name(dt: torch.dtype) -> str:
    """SGLang's spelling of a dtype on the wire (``"bfloat16"``), refusing what it cannot rebuild."""
    name = str(dt).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dt} is not supported in weight updates")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name.removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPES[name.removeprefix("torch.")]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- flattened buckets


@dataclass(frozen=True)
class FlatMeta:
    """Where one tensor lives in a flattened bucket (SGLang's ``FlattenedTensorMetadata`` fields)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int

    @property
    def numel(self) -> int:  # SGLang's ``numel`` is the byte count of the slice
        return self.end_idx - self.start_idx


def flat_layout(names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[FlatMeta]:
    """SGLang's layout: tensors back to back, each ``numel * element_size`` bytes, no padding. SGLang
    refuses a tensor whose offset is not a multiple of its element size, so such a layout is a
    ValueError here (``group_by_bytes`` starts a new bucket instead of producing one)."""
    metas, off = [], 0
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        size = torch.empty((), dtype=dt).element_size()
        if off % size:
            raise ValueError(f"{name}: offset {off} is not aligned to its {dt} elements (SGLang refuses it)")
        n = int(torch.Size(shape).numel()) * size
        metas.append(FlatMeta(name=name, shape=tuple(int(s) for s in shape), dtype=dt, start_idx=off,
                              end_idx=off + n))
        off += n
    return metas


def layout_of(group: list[tuple[str, torch.Tensor]]) -> list[FlatMeta]:
    return flat_layout([n for n, _ in group], [t.dtype for _, t in group], [list(t.shape) for _, t in group])


def flat_size(metas: list[FlatMeta]) -> int:
    return metas[-1].end_idx if metas else 0


def fill_flat(buf: torch.Tensor, group: list[tuple[str, torch.Tensor]], metas: list[FlatMeta]) -> None:
    """The one copy: each source tensor (any device, any strides) into its byte range of ``buf``."""
    for (_, t), m in zip(group, metas, strict=True):
        if m.numel:  # as bytes: a tensor's offset need not be aligned to its dtype in SGLang's layout
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[m.start_idx:m.end_idx].copy_(src)


def _view(buf: torch.Tensor, m: FlatMeta) -> torch.Tensor:
    part = buf[m.start_idx:m.end_idx]
    if m.start_idx % m.dtype.itemsize:  # unaligned: a view is illegal
        return part.clone().view(m.dtype).view(m.shape)
    return part.view(m.dtype).view(m.shape)


def unflatten(buf: torch.Tensor, metas: list[FlatMeta]) -> list[tuple[str, torch.Tensor]]:
    """Named views into a flattened bucket, after checking the layout against the buffer."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"a flattened bucket is a 1-D uint8 tensor, got {buf.dtype} of shape {list(buf.shape)}")
    out = []
    for m in metas:
        want = int(torch.Size(m.shape).numel()) * torch.empty((), dtype=m.dtype).element_size()
        if m.start_idx < 0 or m.numel != want or m.end_idx > buf.numel():
            raise ValueError(f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) do not hold shape "
                             f"{list(m.shape)} x {m.dtype} inside a {buf.numel()}-byte bucket")
        out.append((m.name, _view(buf, m)))
    return out


class ByteGrouper:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor goes alone), fed one tensor at a time.
    ``aligned``: a tensor that would start at an offset not aligned to its dtype starts a new group (SGLang's
    flattened layout has no padding and refuses unaligned tensors)."""

    def __init__(self, max_bytes: int, aligned: bool = True) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes, self.aligned = max_bytes, aligned
        self.group: list[tuple[str, torch.Tensor]] = []
        self.used = 0

    def add(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """Take a tensor; returns the group it closed, if any."""
        size, done = nbytes(t), None
        if self.group and (self.used + size > self.max_bytes or (self.aligned and self.used % t.element_size())):
            done = self.flush()
        self.group.append((name, t))
        self.used += size
        return done

    def flush(self) -> list[tuple[str, torch.Tensor]] | None:
        """The open group (None when empty); a new one starts."""
        done, self.group, self.used = self.group or None, [], 0
        return done


def group_by_bytes(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``ByteGrouper``'s aligned groups of a stream; never holds more than one group."""
    grouper = ByteGrouper(max_bytes)
    for name, t in named:
        if (done := grouper.add(name, t)) is not None:
            yield done
    if (done := grouper.flush()) is not None:
        yield done


class SharedArena:
    """Reusable bucket buffers in shared memory (one slot per bucket index), kept between pushes.

    Why: writing into fresh pages costs several times a memcpy (a page fault per 4 KiB), and a buffer
    that is already a torch shared-memory file pickles as its file name with no copy. Slot ``i`` is
    rewritten by the next push, which starts only after every engine has loaded the previous one.
    """

    def __init__(self, shared: bool = True) -> None:
        self.shared = shared
        self._slots: list[torch.Tensor] = []

    def buffer(self, index: int, size: int) -> torch.Tensor:
        if index < len(self._slots) and self._slots[index].numel() >= size:
            return self._slots[index][:size]
        buf = torch.zeros(max(size, 1), dtype=torch.uint8)  # zero-filled: every page faulted in now, once
        if self.shared:
            with sharing_strategy("file_system"):
                buf.share_memory_()
        if index < len(self._slots):
            self._slots[index] = buf
        else:
            self._slots.append(buf)
        return buf[:size]

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slots)

    def close(self) -> None:
        self._slots.clear()


def share_in_place(tensors: Iterable[torch.Tensor]) -> int:
    """Move the storages of these CPU tensors into shared-memory files (torch's ``file_system`` strategy) in
    place: every tensor and view over them keeps working, on the shared pages from now on. Returns the bytes
    moved (0 once they all are). Why: a same-host weight push hands such tensors to the engine by file name and
    offset (``WeightPusher``), so the engine copies straight from the trainer's parameters instead of from a
    bucket they were first copied into: one copy of the model per push instead of two."""
    moved = 0
    with sharing_strategy("file_system"):
        for t in tensors:
            if t.device.type != "cpu" or t.is_shared():  # a storage shared by an earlier view is skipped here
                continue
            storage = t.untyped_storage()
            storage.share_memory_()
            moved += storage.nbytes()
    return moved


class SharedStaging:
    """CPU tensors in shared memory by name, kept between pushes: where a push's conversions write what they cannot
    hand over as a view of the parameters (q/k/v split out of Megatron's fused layout: ``convert.split_qkv``).
    They then go by reference like the parameters; without it they were new tensors, copied once more into a
    bucket. Rewritten by the next push, which starts only once the engines have loaded this one."""

    def __init__(self) -> None:
        self._by_name: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self._by_name.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            t = torch.zeros(shape, dtype=dtype)
            share_in_place([t])
            self._by_name[name] = t
        return t

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t) for t in self._by_name.values())


# ---------------------------------------------------------------- payloads (/update_weights_from_tensor)

_STRATEGY_LOCK = threading.Lock()


@contextlib.contextmanager
def sharing_strategy(name: str) -> Iterator[None]:
    """torch's sharing strategy is process-wide: switch it only around our own pickling."""
    import torch.multiprocessing as tmp

    with _STRATEGY_LOCK:
        old = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy(name)
        try:
            yield
        finally:
            tmp.set_sharing_strategy(old)


def tensor_sha256(t: torch.Tensor) -> str:
    """SGLang's checksum of one tensor of a LoRA push (``expected_checksums``): sha256 of its bytes, C order."""
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: base64 of a ForkingPickler
    dump; CPU storages go by shared-memory file name so an unrelated process on this host can map them."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

    if torch.cuda.is_available():
        _patch_cuda_reductions()
    buf = io.BytesIO()
    with sharing_strategy("file_system"):
        ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _patch_cuda_reductions() -> None:
    """CUDA payloads name their device by UUID, as SGLang's receivers expect (its ``monkey_patch_torch_reductions``,
    which slime applies too): an index means another GPU in a process that sees the devices in another order.

    Only the sending half: the payload still names torch's ``rebuild_cuda_tensor``, which SGLang's unpickler
    allows and which its model runner has patched to read a UUID. SGLang's own patch is not used: it also
    rewrites CPU tensors' reductions (an IndexError on our shared-memory payloads) and needs the ``sglang``
    package in the trainer. We set the attribute SGLang's patch checks, so at most one of the two is in force."""
    from torch.multiprocessing import reductions

    if hasattr(reductions, "_reduce_tensor_original"):
        return
    reductions._reduce_tensor_original = reductions.reduce_tensor  # type: ignore[attr-defined]
    reductions.reduce_tensor = _reduce_tensor_with_uuid
    reductions.init_reductions()


_CUDA_DEVICE_ARG = 6  # the device's position in rebuild_cuda_tensor's arguments (unchanged since torch 1.x)


def _reduce_tensor_with_uuid(*args: Any, **kwargs: Any) -> Any:
    from torch.multiprocessing import reductions

    rebuild, rebuild_args = reductions._reduce_tensor_original(*args, **kwargs)  # type: ignore[attr-defined]
    if rebuild is reductions.rebuild_cuda_tensor and isinstance(rebuild_args[_CUDA_DEVICE_ARG], int):
        uuid = cuda_device_uuid(rebuild_args[_CUDA_DEVICE_ARG])
        rebuild_args = (*rebuild_args[:_CUDA_DEVICE_ARG], uuid, *rebuild_args[_CUDA_DEVICE_ARG + 1:])
    return rebuild, rebuild_args


def cuda_device_uuid(index: int) -> str:
    """The UUID SGLang's receivers look a CUDA device up by (``GPU-...``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def flattened_payload(flat: torch.Tensor, metas: list[FlatMeta]) -> dict[str, Any]:
    """The object SGLang's ``_update_weights_from_flattened_bucket`` reads."""
    return {"flattened_tensor": flat,
            "metadata": [types.SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype,
                                               start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
                         for m in metas]}


def serialize_flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> str:
    """One flattened bucket of ``named`` as an ``/update_weights_from_tensor`` payload (a fresh shared
    buffer; the trainer's pusher packs into a reusable ``SharedArena`` instead)."""
    metas = layout_of(named)
    flat = torch.empty(flat_size(metas), dtype=torch.uint8)
    fill_flat(flat, named, metas)
    with sharing_strategy("file_system"):
        flat.share_memory_()
    return serialize(flattened_payload(flat, metas))


# What a payload may reference: torch's tensor/storage rebuild functions for CPU shared memory, plain
# containers and SimpleNamespace metadata (a subset of SGLang's SafeUnpickler allow-list). Anything else
# (e.g. os.system) is refused: a pickle from the network must never run code.
_ALLOWED_GLOBALS = {
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "int"),
    ("builtins", "str"), ("builtins", "bool"), ("builtins", "float"),
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("types", "SimpleNamespace"),
    ("torch", "Size"), ("torch", "Tensor"), ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
} | {("torch", name) for name in _DTYPES}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a weight payload")
        if module == "sglang.srt.weight_sync.tensor_bucket":  # SGLang's own metadata class, by attribute
            return _AnyNamespace
        if module == "torch.multiprocessing.reductions" and name in _SHM_REBUILDERS:
            return _SHM_REBUILDERS[name]
        return super().find_class(module, name)


# Receiving shared-memory tensors WITHOUT torch's shm manager. torch's own rebuild connects the receiver
# to the sender's ``torch_shm_manager``; when the sender dies first (a trainer rank killed, a job
# cancelled), the receiver's next free of such a storage hits a broken socket and the C++ runtime
# aborts the whole process: an engine must never die of that. So the receiver maps the named file in
# /dev/shm itself (it stays valid for as long as it is mapped, even once unlinked).
_SHM_HEADER = 64  # torch's refcounted shared-memory files start with a 64-byte counter (MapAllocator)


@dataclass
class _ShmBytes:
    """The payload bytes of one torch shared-memory file, mapped read-only by this process."""

    data: torch.Tensor  # uint8 over the mapping
    dtype: torch.dtype = torch.uint8


class _Mappings:
    """Shared-memory files this process has mapped, by name, kept between pushes: the trainer reuses its
    bucket files every push, and mapping 256 MB again costs more than copying it. A file that is gone
    (its sender freed it) is dropped from here; beyond ``cap`` bytes the least recently used go."""

    def __init__(self, cap: int = 8 * 2**30) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._maps: dict[str, torch.Tensor] = {}
        self._bytes = 0  # of everything in _maps: a push of a trainer's parameters names hundreds of files

    def get(self, name: str, nbytes: int) -> torch.Tensor:
        import os

        path = os.path.join("/dev/shm", name)
        with self._lock:
            data = self._drop(name)
            if data is None or data.numel() != nbytes:
                # a new file: first drop the mappings of files that are gone (on a miss only: checking on every
                # hit made a push of hundreds of parameter files quadratic)
                for gone in [n for n in self._maps if not os.path.exists(os.path.join("/dev/shm", n))]:
                    self._drop(gone)
                data = _map_shm(path, nbytes)
            self._maps[name] = data  # most recent last
            self._bytes += data.numel()
            while len(self._maps) > 1 and self._bytes > self.cap:
                self._drop(next(iter(self._maps)))
            return data

    def _drop(self, name: str) -> torch.Tensor | None:
        data = self._maps.pop(name, None)
        if data is not None:
            self._bytes -= data.numel()
        return data


def _map_shm(path: str, nbytes: int) -> torch.Tensor:
    import mmap
    import os
    import warnings

    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        header = total - nbytes
        if header not in (0, _SHM_HEADER):
            raise pickle.UnpicklingError(f"{path}: {total} bytes cannot hold a {nbytes}-byte storage")
        mm = mmap.mmap(f.fileno(), total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only memory: torch warns that writes would fault; we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)[header:]


SHM_MAPPINGS = _Mappings()


def _rebuild_storage_filename(cls: Any, manager: Any, handle: bytes | str, size: int,
                              dtype: torch.dtype | None = None) -> _ShmBytes:
    name = (handle.decode() if isinstance(handle, bytes) else str(handle)).lstrip("/")
    if not name or "/" in name or name.startswith("."):
        raise pickle.UnpicklingError(f"bad shared-memory name {handle!r}")
    nbytes = int(size) * (torch.empty((), dtype=dtype).element_size() if dtype is not None else 1)
    return _ShmBytes(data=SHM_MAPPINGS.get(name, nbytes), dtype=dtype or torch.uint8)


def _rebuild_typed_storage(storage: Any, dtype: torch.dtype) -> Any:
    if isinstance(storage, _ShmBytes):
        return _ShmBytes(data=storage.data, dtype=dtype)
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def _rebuild_tensor(cls: Any, storage: Any, metadata: tuple) -> torch.Tensor:
    offset, size, stride, _requires_grad = metadata
    if not isinstance(storage, _ShmBytes):
        raise pickle.UnpicklingError("a CPU tensor in a weight payload must live in shared memory")
    base = storage.data.view(storage.dtype)
    return base.as_strided(tuple(size), tuple(stride), base.storage_offset() + int(offset))


_SHM_REBUILDERS = {"rebuild_storage_filename": _rebuild_storage_filename,
                   "rebuild_typed_storage": _rebuild_typed_storage, "rebuild_tensor": _rebuild_tensor}


class _AnyNamespace(types.SimpleNamespace):
    """Stands in for SGLang's ``FlattenedTensorMetadata`` (a dataclass restored from its ``__dict__``)."""


def load_payload(data: str | bytes) -> Any:
    """Inverse of ``serialize`` for receivers, with the allow-list above; raises ValueError on bad input."""
    import torch.multiprocessing  # noqa: F401

    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
        return _SafeUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError, RuntimeError, OSError) as e:
        raise ValueError(f"unreadable weight payload: {e}") from None


def payload_tensors(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """Named tensors of an unpickled payload: a flattened bucket dict, or a list of (name, tensor)."""
    if load_format == FLATTENED_BUCKET:
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise ValueError("a flattened_bucket payload is {'flattened_tensor': ..., 'metadata': [...]}")
        try:
            metas = [FlatMeta(name=str(m.name), shape=tuple(int(s) for s in m.shape), dtype=m.dtype,
                              start_idx=int(m.start_idx), end_idx=int(m.end_idx)) for m in obj["metadata"]]
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"bad flattened_bucket metadata: {e}") from None
        if not all(isinstance(m.dtype, torch.dtype) for m in metas):
            raise ValueError("flattened_bucket metadata dtypes must be torch dtypes")
        return unflatten(obj["flattened_tensor"], metas)
    if load_format not in (None, "direct"):
        raise ValueError(f"unsupported load_format {load_format!r} (use flattened_bucket, direct or none)")
    if not isinstance(obj, list | tuple) or not all(
            isinstance(x, list | tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
            for x in obj):
        raise ValueError("a payload without load_format is a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in obj]


# ---------------------------------------------------------------- process group (/init_weights_update_group)


def host_weight_rendezvous(master_address: str, master_port: int, world_size: int,
                           timeout_s: float = 600.0) -> Any:
    """Rank 0's rendezvous server (a TCPStore master), held apart from the group it forms.

    Why apart: torch's ``tcp://`` rendezvous keeps the server inside the group's own store, so the port
    stays open (on every interface, with no authentication) for as long as the group lives, which for
    weight pushes is the whole job. Held here, the caller drops it once every member has joined, and the
    port is open only while a group forms; gloo needs no store after its mesh is connected. Rank 0 then
    joins as a client (``open_weight_group(..., hosted=True)``)."""
    from torch.distributed import TCPStore

    return TCPStore(master_address, master_port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False, multi_tenant=False)


def open_weight_group(master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
                      backend: str = "gloo", timeout_s: float = 600.0, *, hosted: bool = False) -> Any:
    """Join (rank > 0) or create (rank 0) a weight-update group the way SGLang's engines do.

    Outside the default process group on purpose: the trainer already has one (Megatron's), the CPU
    engine has none. ``hosted``: the rendezvous server runs apart (``host_weight_rendezvous``), so every
    rank, 0 included, connects to it as a client. Returns a ProcessGroup for
    ``torch.distributed.broadcast(t, src=0, group=pg)``.
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    host = f"[{master_address}]" if ":" in master_address and not master_address.startswith("[") else master_address
    timeout = timedelta(seconds=timeout_s)
    if hosted:
        store = TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
    else:
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)  # SGLang's outer prefix: without it the ranks never meet
    with _gloo_interface_towards(master_address if backend == "gloo" else None):
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                          backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@contextlib.contextmanager
def _gloo_interface_towards(master_address: str | None) -> Iterator[None]:
    """Gloo binds to the address the machine's hostname resolves to unless GLOO_SOCKET_IFNAME names an
    interface; that address is often not on the route to the peers (Debian's 127.0.1.1, a container or
    network namespace). So, unless the user set it, use the interface that holds our address towards
    rank 0, for the construction of this group only."""
    import os

    name = None
    if master_address is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        try:
            name = interface_of(address_towards(master_address))
        except OSError:
            name = None
    if name is None:
        yield
        return
    with _STRATEGY_LOCK:  # environment changes are process-wide: one group construction at a time
        os.environ["GLOO_SOCKET_IFNAME"] = name
        try:
            yield
        finally:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def close_weight_group(pg: Any) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # a group whose peer died cannot always be torn down cleanly
        dist.destroy_process_group(pg)
