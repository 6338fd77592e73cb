"""A LoRA job's push: its adapter loaded into every engine under a new versioned name, nothing paused.

Why not the weight push: SGLang serves many adapters over one base, and ``/load_lora_adapter_from_tensors`` adds one
while every request (the base's, other adapters', the older version's) keeps running; stock SGLang cannot replace a
loaded adapter in place, so each version gets a name of its own and the old one is unloaded after the gateway's
alias has moved (``unload``, which the engine makes wait for that version's requests). The tensors go as one
flattened bucket in shared memory, by reference (engines on this host); with ``verify`` also SGLang's
``expected_checksums``, and the engine refuses an adapter whose bytes it did not receive exactly. An engine on
another host gets the version as a PEFT directory on its own disk (rollout/adapter_staging.py, through Ray) and
``/load_lora_adapter`` by path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from slime_server.rollout.adapter_staging import stage
from slime_server.rollout.engine_auth import auth_headers
from slime_server.rollout.engine_info import engine_tp_size
from slime_server.rollout.protocol import LoadLoRAAdapterFromTensorsReqInput, LoadLoRAAdapterReqInput
from slime_server.trainer.peft_io import peft_files
from slime_server.trainer.weight_push import EnginePushStats, PushStats, WeightPushError, http_error_text
from slime_server.utils.net import engine_limits, is_local_host
from slime_server.weights import (
    FLATTENED_BUCKET,
    SharedArena,
    fill_flat,
    flat_size,
    flattened_payload,
    layout_of,
    serialize,
    tensor_sha256,
)


class AdapterPusher:
    """Loads one job's adapter versions into a fixed set of engines (the loop's EngineControl unloads them: the
    engines make that wait for the version's requests, which the trainer must not)."""

    def __init__(self, engine_urls: Sequence[str], *, api_key: str | None = None, timeout: float = 600.0,
                 verify: bool = False) -> None:
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.verify = verify  # send sha256 sums (both sides hash every byte: ~40% of a SmolLM2 rank-16 push)
        self.remote = {u for u in self.engine_urls if not is_local_host(httpx.URL(u).host)}  # staged on their disk
        self._client = httpx.Client(timeout=timeout, headers=auth_headers(api_key), limits=engine_limits())
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engine_urls)), thread_name_prefix="adapter-push")
        self._arena = SharedArena(shared=True)
        self._tp: dict[str, int] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
        self._arena.close()

    def _post(self, url: str, path: str, body: Any) -> None:
        try:
            r = self._client.post(f"{url}{path}", content=body.model_dump_json(exclude_none=True),
                                  headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            raise RuntimeError(f"{path}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise RuntimeError(f"{path} -> HTTP {r.status_code}: {http_error_text(r)}")

    def _on_all(self, fn: Any) -> dict[str, str]:
        futures = [(u, self._pool.submit(fn, u)) for u in self.engine_urls]
        return {u: str(f.exception()) for u, f in futures if f.exception() is not None}

    def push(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> PushStats:
        """Load the adapter (PEFT ``config`` and tensors by PEFT name) into every engine as ``name``; raises
        ``WeightPushError`` naming each engine that did not take it."""
        t0 = time.perf_counter()
        named = sorted(tensors.items())
        metas = layout_of(named)
        local = any(u not in self.remote for u in self.engine_urls)
        payload = self._shared_payload(named, metas) if local else ""  # the bucket only engines here can map
        sums = {n: tensor_sha256(t) for n, t in named} if self.verify and local else None
        files = peft_files(config, tensors) if self.remote else {}
        pack_s = time.perf_counter() - t0
        spent = dict.fromkeys(self.engine_urls, 0.0)

        def load(url: str) -> None:
            t = time.perf_counter()
            try:
                if url in self.remote:
                    self._load_staged(url, name, files)
                    return
                if url not in self._tp:  # an SGLang engine with --tp-size 2 takes one payload per rank
                    self._tp[url] = engine_tp_size(self._client, url, timeout=10) or 1
                self._post(url, "/load_lora_adapter_from_tensors", LoadLoRAAdapterFromTensorsReqInput(
                    lora_name=name, config_dict=config, serialized_named_tensors=[payload] * self._tp[url],
                    load_format=FLATTENED_BUCKET, expected_checksums=sums))
            finally:
                spent[url] = time.perf_counter() - t

        errors = self._on_all(load)
        mode = "adapter-staged" if self.remote else "adapter"  # staged: some engine loaded it from its disk
        if errors:
            raise WeightPushError(name, {u: None if u in errors else name for u in self.engine_urls}, errors)
        total = time.perf_counter() - t0
        size = flat_size(metas)
        return PushStats(version=name, sent=True, mode=mode, tensors=len(named), bytes=size, buckets=1,
                         pack_seconds=pack_s, seconds=total, gbps=size / 1e9 / total if total else 0.0,
                         engines=[EnginePushStats(url=u, seconds=spent[u], gbps=size / 1e9 / spent[u] if spent[u]
                                                  else 0.0, weight_version=name) for u in self.engine_urls])

    def _shared_payload(self, named: list[tuple[str, torch.Tensor]], metas: list[Any]) -> str:
        """The tensors as one flattened bucket in this host's shared memory, serialized by reference."""
        flat = self._arena.buffer(0, flat_size(metas))
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) == 1 and all(a.end_idx == b.start_idx for a, b in zip(metas, metas[1:], strict=False)):
            # one dtype, no gaps: one concatenation into the bucket instead of a copy per tensor (hundreds)
            torch.cat([t.detach().reshape(-1) for _, t in named], out=flat.view(dtypes.pop()))
        else:
            fill_flat(flat, named, metas)
        return serialize(flattened_payload(flat, metas))

    def _load_staged(self, url: str, name: str, files: dict[str, bytes]) -> None:
        """An engine on another host: the version's PEFT files written on its disk, then loaded by path."""
        path = stage(httpx.URL(url).host, name, files)  # kept until the version is unloaded: an engine reloads
        self._post(url, "/load_lora_adapter", LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))  # from it
