"""The CPU engine's LoRA routes, SGLang 0.5.23's: ``/load_lora_adapter``, ``/unload_lora_adapter`` and the adapters
in ``/v1/models``.

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
from slime_server.rollout.protocol import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput

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

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        req = await parse_body(request, UnloadLoRAAdapterReqInput)
        return await update(lambda: engine.adapters.unload(req.lora_name), unload=True)
