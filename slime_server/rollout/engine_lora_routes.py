"""The CPU engine's LoRA routes, SGLang 0.5.23's: ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter`` and the adapters in ``/v1/models``.

Answers as SGLang's ``http_server`` gives them: ``LoRAUpdateOutput`` with 200 on success (``error_message`` "" and
every loaded name -> path), 400 on failure with SGLang's message; loading and unloading run off the event loop
(an unload waits for the adapter's requests to finish).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from slime_server.lora_format import AdapterError
from slime_server.rollout.cpu_engine import CPUEngine
from slime_server.rollout.protocol import (
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
)
from slime_server.weights import FLATTENED_BUCKET, load_payload, payload_tensors

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def _answer(out: LoRAUpdateOutput) -> JSONResponse:
    return JSONResponse(out.model_dump(), status_code=200 if out.success else 400)


def add_lora_routes(app: FastAPI, engine: CPUEngine, parse_body: Callable[..., Awaitable[Any]],
                    served_model_name: str) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """SGLang's list: the served model, then (LoRA on) one card per loaded adapter with its parent."""
        created = int(time.time())
        cards = [{"id": served_model_name, "object": "model", "created": created, "owned_by": "sglang",
                  "root": served_model_name, "max_model_len": engine.context_length}]
        for name, path in (engine.adapters.loaded() if engine.adapters else {}).items():
            cards.append({"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": path,
                          "parent": served_model_name, "max_model_len": None})
        return {"object": "list", "data": cards}

    async def update(fn: Callable[[], dict[str, str]], unload: bool) -> JSONResponse:
        if engine.adapters is None:
            return _answer(LoRAUpdateOutput(success=False, error_message=NOT_ENABLED))
        try:
            loaded = await asyncio.to_thread(fn)
        except AdapterError as e:  # SGLang: an unknown name fails before the workers (no map), a load in them
            return _answer(LoRAUpdateOutput(success=False, error_message=str(e),
                                            loaded_adapters=None if unload else engine.adapters.loaded()))
        return _answer(LoRAUpdateOutput(success=True, loaded_adapters=loaded))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        req = await parse_body(request, LoadLoRAAdapterReqInput)
        return await update(lambda: engine.adapters.load(req.lora_name, req.lora_path, req.pinned), unload=False)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(request: Request) -> JSONResponse:
        req = await parse_body(request, LoadLoRAAdapterFromTensorsReqInput)
        return await update(lambda: engine.adapters.load_tensors(
            req.lora_name, req.config_dict, tensors_of(req), req.pinned, req.expected_checksums), unload=False)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        req = await parse_body(request, UnloadLoRAAdapterReqInput)
        return await update(lambda: engine.adapters.unload(req.lora_name), unload=True)


def tensors_of(req: LoadLoRAAdapterFromTensorsReqInput) -> dict[str, Any]:
    """This engine's payload (TP rank 0's) as PEFT name -> tensor: a flattened bucket or SGLang's plain dict."""
    if req.added_tokens_config:
        raise AdapterError(f"{req.lora_name}: adapters with added tokens are not supported")
    if not req.serialized_named_tensors:
        raise AdapterError("serialized_named_tensors must hold one payload per TP rank")
    try:
        data = load_payload(req.serialized_named_tensors[0])
        if req.load_format == FLATTENED_BUCKET:
            return dict(payload_tensors(data, FLATTENED_BUCKET))
        if req.load_format not in (None, "direct"):
            raise ValueError(f"unsupported load_format {req.load_format!r} (flattened_bucket or none)")
        if isinstance(data, dict):
            return data
        return dict(payload_tensors(data, None))
    except ValueError as e:
        raise AdapterError(f"{req.lora_name}: {e}") from None
