"""What the CPU engine does with LoRA adapters, as SGLang 0.5.23 does it: load, unload, resolve a request's
adapter, keep at most ``max_loaded_loras``.

SGLang's rules kept here (its ``tokenizer_manager`` / ``lora_registry`` / ``lora_manager``): a name already loaded
cannot be loaded again (publish an update under a new name); unloading waits until no request in flight uses the
adapter, and requests for it are refused meanwhile; loading past ``max_loaded_loras`` unloads the least recently
used unpinned adapter; every name ever loaded from a path is remembered, and a request naming one that was unloaded
or evicted loads it again first (it waits, it does not fail). The tensors are read and checked on the caller's
thread; only the copy into the bank's slot runs on the scheduler thread, between two steps.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from slime_server.lora_format import PROJECTIONS, AdapterError, parse_config, parse_tensor_name, read_config
from slime_server.rollout.engine_config import EngineConfig
from slime_server.rollout.engine_lora import AdapterBank, LoadedAdapter, ModelDims
from slime_server.weights import tensor_sha256

DEFAULT_MAX_RANK = 64
FROM_TENSORS = "__tensor__"  # SGLang's registry path of an adapter loaded from tensors (never reloaded on demand)
# SGLang's fused names for --lora-target-modules, and "all"
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def dims_of(lean: Any) -> ModelDims:
    """The shapes of a ``LeanForward``'s model that an adapter must fit."""
    first = lean.layers[0]
    down = first.down if first.down is not None else first.experts[0][1]  # an MoE layer: an expert's
    return ModelDims(layers=len(lean.layers), hidden=int(lean.embed.shape[1]), q_size=lean.q_size,
                     kv_size=lean.kv_size, intermediate=int(down.shape[1]))


def target_modules(names: list[str] | None) -> tuple[str, ...]:
    """``--lora-target-modules`` as projections (SGLang's names: the seven, qkv_proj, gate_up_proj, or 'all')."""
    if not names or names == ["all"] or names == ["all-linear"]:
        return PROJECTIONS
    chosen: set[str] = set()
    for n in names:
        if n in _FUSED:
            chosen |= set(_FUSED[n])
        elif n in PROJECTIONS:
            chosen.add(n)
        else:
            raise ValueError(f"--lora-target-modules: {n!r} is not one of {', '.join(PROJECTIONS)}, qkv_proj, "
                             "gate_up_proj, all")
    return tuple(p for p in PROJECTIONS if p in chosen)


def parse_lora_path(item: str) -> tuple[str, str, bool]:
    """One ``--lora-paths`` item: ``PATH``, ``NAME=PATH`` or SGLang's JSON ``{"lora_name", "lora_path",
    "pinned"}`` -> (name, path, pinned)."""
    item = item.strip()
    if item.startswith("{") and item.endswith("}"):
        spec = json.loads(item)
        return str(spec["lora_name"]), str(spec["lora_path"]), bool(spec.get("pinned", False))
    name, eq, path = item.partition("=")
    return (name, path, False) if eq else (item, item, False)


class EngineAdapters:
    """The engine's adapters: the bank (engine_lora.py) plus SGLang's registry rules."""

    def __init__(self, config: EngineConfig, lean: Any, on_scheduler: Callable[[Callable[[], Any]], Any],
                 in_flight: Callable[[LoadedAdapter], int]) -> None:
        """Adapters over ``lean`` (the engine's ``LeanForward``, which then computes with them); ``on_scheduler(fn)``
        runs ``fn`` on the scheduler thread between steps and returns its result; ``in_flight(adapter)`` counts the
        queued and running requests that use ``adapter``."""
        starting = [parse_lora_path(p) for p in config.lora_paths]
        self.max_loaded = config.max_loaded_loras or max(config.max_loras_per_batch, len(starting))
        if self.max_loaded < len(starting):
            raise ValueError(f"--max-loaded-loras {self.max_loaded} is below the {len(starting)} --lora-paths")
        max_rank = config.max_lora_rank
        if max_rank is None:
            max_rank = max((read_config(path).rank for _, path, _ in starting), default=DEFAULT_MAX_RANK)
        targets = target_modules(config.lora_target_modules)
        if lean.num_experts:  # an MoE model's experts take no adapter (as its trainer trains none): attention only
            targets = tuple(t for t in targets if t not in MLP_PROJECTIONS)
            if not targets:
                raise ValueError("--lora-target-modules names only MLP projections; an MoE model's experts take no "
                                 "LoRA adapter (q_proj, k_proj, v_proj, o_proj do)")
        self.bank = AdapterBank(dims_of(lean), lean.embed.dtype, max_rank, self.max_loaded, targets)
        if lean.gemv_target is None:  # --decode-kernel torch (or no compiler): torch's ops throughout
            self.bank.kernel = None
        lean.lora = self.bank
        self._on_scheduler, self._in_flight = on_scheduler, in_flight
        self._lock = threading.RLock()  # one load / unload at a time
        self.known: dict[str, tuple[str, bool]] = {}  # name -> (path, pinned) of every adapter loaded from a path
        self._draining: set[str] = set()
        self._used: OrderedDict[str, None] = OrderedDict()  # least recently requested first
        self._lru_lock = threading.Lock()  # _used alone: a request's lookup never waits for a load or a drain
        for name, path, pinned in starting:
            self.load(name, path, pinned)

    def loaded(self) -> dict[str, str]:
        """name -> path of every loaded adapter (SGLang's ``loaded_adapters``)."""
        return {a["lora_name"]: a["lora_path"] for a in self.bank.listing()}

    def load(self, name: str, path: str, pinned: bool = False) -> dict[str, str]:
        with self._lock:
            if self.bank.get(name) is not None:
                raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
            config, tensors = self.bank.read(path)
            return self._load_checked(name, path, config, tensors, pinned)

    def _load_checked(self, name: str, path: str, config: Any, tensors: dict[tuple[int, str, str], Any],
                      pinned: bool) -> dict[str, str]:
        with self._lock:
            if self.bank.get(name) is not None:
                raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
            pinned_now = sum(a.pinned for a in self.bank.adapters.values())
            if pinned and pinned_now + 1 >= self.max_loaded:
                raise AdapterError(f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to "
                                   "pin all slots in the LoRA memory pool")
            while len(self.bank.adapters) >= self.max_loaded:
                self._evict()
            self._on_scheduler(lambda: self.bank.load(name, path, config, tensors, pinned))
            self.known[name] = (path, pinned)
            with self._lru_lock:
                self._used[name] = None
            return self.loaded()

    def load_tensors(self, name: str, config_dict: dict[str, Any], tensors: dict[str, Any], pinned: bool = False,
                     expected_checksums: dict[str, str] | None = None) -> dict[str, str]:
        """SGLang's ``/load_lora_adapter_from_tensors``: a PEFT config and its tensors by name, checked against
        ``expected_checksums`` (sha256 of each tensor's bytes, every name exactly) before anything loads."""
        if expected_checksums is not None:
            _check_sums(tensors, expected_checksums)
        config = parse_config(config_dict, name)
        self.bank.check(config, name)
        try:
            keyed = {parse_tensor_name(k): v for k, v in tensors.items()}
        except AttributeError:
            raise AdapterError(f"{name}: the payload must map PEFT tensor names to tensors") from None
        checked = self.bank.checked(config, keyed, name)
        return self._load_checked(name, FROM_TENSORS, config, checked, pinned)

    def unload(self, name: str) -> dict[str, str]:
        with self._lock:
            adapter = self.bank.get(name)
            if adapter is None:
                raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.loaded())}")
            self._draining.add(name)  # new requests for it are refused from now on
            try:
                # SGLang waits for the requests using it; the last check and the unload are one scheduler task,
                # under the lock submit() queues with, so no request slips in between
                while not self._on_scheduler(lambda: self._unload_if_idle(adapter)):
                    time.sleep(0.01)
            finally:
                self._draining.discard(name)
            with self._lru_lock:
                self._used.pop(name, None)
            return self.loaded()

    def _unload_if_idle(self, adapter: LoadedAdapter) -> bool:
        if self._in_flight(adapter):
            return False
        self.bank.unload(adapter.name)
        return True

    def forget(self, name: str) -> None:
        """Not reloaded on demand any more (a caller deleting the adapter for good)."""
        self.known.pop(name, None)

    def _evict(self) -> None:
        """Unload the least recently requested unpinned adapter (SGLang's LRU eviction)."""
        with self._lru_lock:
            order = list(self._used)
        for name in order:
            adapter = self.bank.get(name)
            if adapter is not None and not adapter.pinned:
                self.unload(name)
                return
        raise AdapterError(f"every one of the {self.max_loaded} loaded adapters is pinned: nothing to evict")

    def resolve(self, name: str | None) -> LoadedAdapter | None:
        """The adapter a request names (None: the base), loaded again first if it was unloaded or evicted (that
        waits for the load: call it off the event loop then); a name never loaded is SGLang's error."""
        if name is None:
            return None
        adapter = self.bank.get(name)
        if adapter is None or name in self._draining:
            if name in self._draining:
                raise AdapterError(f"LoRA adapter {name} is being unloaded")
            if name not in self.known:
                raise AdapterError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                   f"All loaded adapters: {sorted(self.loaded())}.")
            with self._lock:
                adapter = self.bank.get(name)
                if adapter is None:
                    path, pinned = self.known[name]
                    if path == FROM_TENSORS:  # SGLang tries to load "__tensor__" as a path, and fails so
                        raise AdapterError(f"Failed to implicitly load LoRA adapter {name}: it was loaded from "
                                           "tensors and has no path to load it again from")
                    self.load(name, path, pinned)
                    adapter = self.bank.get(name)
        with self._lru_lock:
            self._used[name] = None
            self._used.move_to_end(name)
        return adapter


def _check_sums(tensors: dict[str, Any], expected: dict[str, str]) -> None:
    """SGLang's ``[LORA-CHECK]``: every expected name present with that sha256, no other tensor."""
    mismatch, missing = [], []
    for name, want in expected.items():
        t = tensors.get(name)
        if t is None:
            missing.append(name)
        elif tensor_sha256(t) != want:
            mismatch.append(name)
    extra = [n for n in tensors if n not in expected]
    if mismatch or missing or extra:
        raise AdapterError(f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected: {len(mismatch)} "
                           f"value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, {len(extra)} extra "
                           f"{extra[:5]}")
