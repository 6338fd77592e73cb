"""SGLang's weight-update routes on the CPU engine, with SGLang's request models and answers.

- ``/init_weights_update_group`` joins a gloo group with the trainer's rank 0 (SGLang's scheme, see
  ``weights.open_weight_group``; the engine is one rank: ``rank_offset``), ``/destroy_weights_update_group``
  leaves it.
- ``/update_weights_from_distributed`` receives the listed tensors by broadcast from rank 0 (one flat
  tensor per bucket with ``load_format="flattened_bucket"``, else one broadcast per tensor, in order).
- ``/update_weights_from_tensor`` takes this engine's payload (``serialized_named_tensors[0]``: the CPU
  engine is TP rank 0) whose tensors live in shared memory: no bytes travel over HTTP.
- ``/update_weights_from_disk`` loads a checkpoint's safetensors.

Each request's tensors are loaded atomically between two decode steps; ``weight_version`` is taken
with them, and ``flush_cache`` fails the call when the engine is not idle, as SGLang 0.5.23 does
(``success: false``, HTTP 400, the version unchanged). Answers: ``{"success", "message"}``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from slime_server.rollout.cpu_engine import BadRequest, CPUEngine, FlushRefused
from slime_server.rollout.protocol import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from slime_server.weights import (
    FLATTENED_BUCKET,
    SHM_MAPPINGS,
    close_weight_group,
    dtype_from_name,
    flat_layout,
    flat_size,
    load_payload,
    open_weight_group,
    payload_tensors,
    unflatten,
)

log = logging.getLogger(__name__)
GROUP_TIMEOUT_S = 300.0
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running "
                 "or queued. Retract or finish them, then call /flush_cache.")


def _answer(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


class WeightUpdates:
    """The engine's weight-update groups and the four update routes' logic (blocking; run in threads)."""

    def __init__(self, engine: CPUEngine) -> None:
        self.engine = engine
        self.groups: dict[str, Any] = {}
        self._lock = threading.Lock()
        # keep the trainer's bucket files mapped between pushes: twice the model's bytes at most
        SHM_MAPPINGS.cap = 2 * engine.weight_bytes

    def init_group(self, req: InitWeightsUpdateGroupReqInput) -> str:
        if req.backend != "gloo":
            raise BadRequest(f"backend {req.backend!r}: the CPU engine joins weight-update groups with gloo "
                             "(SGLang on GPU uses nccl)")
        if not req.group_name:
            raise BadRequest("group_name must not be empty")
        with self._lock:
            if req.group_name in self.groups:
                raise BadRequest(f"group {req.group_name!r} exists: destroy it first")
        pg = open_weight_group(req.master_address, req.master_port, req.world_size, req.rank_offset,
                               req.group_name, backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        with self._lock:
            self.groups[req.group_name] = pg
        return "Succeeded to initialize custom process group."

    def destroy_group(self, req: DestroyWeightsUpdateGroupReqInput) -> str:
        with self._lock:
            pg = self.groups.pop(req.group_name, None)
        if pg is None:
            raise BadRequest("The group to be destroyed does not exist.")
        close_weight_group(pg)
        return "Succeeded to destroy custom process group."

    def from_distributed(self, req: UpdateWeightsFromDistributedReqInput) -> int:
        import torch.distributed as dist

        pg = self.groups.get(req.group_name)
        if pg is None:
            raise BadRequest(f"Group {req.group_name} not in {list(self.groups)}. "
                             "Please call `init_weights_update_group` first.")
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            raise BadRequest("names, dtypes and shapes must have the same length")
        try:
            dtypes = [dtype_from_name(d) for d in req.dtypes]
        except ValueError as e:
            raise BadRequest(str(e)) from None
        # Refuse what cannot load BEFORE receiving? No: rank 0 broadcasts regardless, so a refusal here
        # would leave it waiting. Receive first, then refuse (as SGLang does).
        if req.load_format == FLATTENED_BUCKET:
            metas = flat_layout(req.names, dtypes, req.shapes)
            flat = torch.empty(flat_size(metas), dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=pg)
            named = unflatten(flat, metas)
        elif req.load_format is None:
            named = [(n, torch.empty(shape, dtype=dt)) for n, dt, shape in zip(req.names, dtypes, req.shapes,
                                                                               strict=True)]
            works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]
            for w in works:
                w.wait()
        else:
            raise BadRequest(f"unsupported load_format {req.load_format!r}")
        return self._load(named, req.weight_version, req.flush_cache, req.abort_all_requests)

    def from_tensor(self, req: UpdateWeightsFromTensorReqInput) -> int:
        if not req.serialized_named_tensors:
            raise BadRequest("serialized_named_tensors must hold one payload per TP rank")
        try:
            named = payload_tensors(load_payload(req.serialized_named_tensors[0]), req.load_format)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return self._load(named, req.weight_version, req.flush_cache, req.abort_all_requests)

    def from_disk(self, req: UpdateWeightFromDiskReqInput) -> int:
        if req.abort_all_requests:
            self.engine.abort(abort_all=True)
        return self.engine.load_weights_from_disk(req.model_path, req.weight_version, flush=req.flush_cache)

    def _load(self, named: list[tuple[str, torch.Tensor]], version: str | None, flush: bool, abort: bool) -> int:
        if abort:
            self.engine.abort(abort_all=True)
        return self.engine.load_weights(named, version, flush=flush)

    def close(self) -> None:
        with self._lock:
            groups, self.groups = list(self.groups.values()), {}
        for pg in groups:
            close_weight_group(pg)


def add_weight_routes(app: FastAPI, engine: CPUEngine, parse_body: Any) -> WeightUpdates:
    """Register the update routes on ``app``; ``parse_body(request, model)`` validates bodies (-> 400)."""
    updates = WeightUpdates(engine)

    async def run(fn: Any, req: Any) -> tuple[bool, str, int | str]:
        try:
            out = await asyncio.to_thread(fn, req)
        except FlushRefused:
            return False, FLUSH_REFUSED, 0
        except (BadRequest, ValueError, OSError, RuntimeError) as e:
            return False, f"Failed to update weights: {e}", 0
        return True, out if isinstance(out, str) else f"Succeeded to update model weights ({out} tensors).", out

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        req = await parse_body(request, InitWeightsUpdateGroupReqInput)
        try:
            msg = await asyncio.to_thread(updates.init_group, req)
        except (BadRequest, ValueError, RuntimeError, OSError) as e:
            return _answer(False, f"Failed to initialize custom process group: {e}.")
        return _answer(True, msg)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        req = await parse_body(request, DestroyWeightsUpdateGroupReqInput, allow_empty=True)
        try:
            return _answer(True, await asyncio.to_thread(updates.destroy_group, req))
        except BadRequest as e:
            return _answer(False, str(e))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        ok, msg, _ = await run(updates.from_distributed, await parse_body(request, UpdateWeightsFromDistributedReqInput))
        return _answer(ok, msg)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        ok, msg, _ = await run(updates.from_tensor, await parse_body(request, UpdateWeightsFromTensorReqInput))
        return _answer(ok, msg)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        ok, msg, _ = await run(updates.from_disk, await parse_body(request, UpdateWeightFromDiskReqInput))
        return _answer(ok, msg, num_paused_requests=0)

    return updates
