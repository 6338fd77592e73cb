"""HTTP front of the CPU engine, speaking SGLang's native protocol (so sgl-router, the gateway and the
trainer cannot tell it from a real SGLang server).

    python -m slime_server.rollout.engine_server --model-path PATH --host 127.0.0.1 --port 30000

Handlers only parse, validate and enqueue; the engine's scheduler thread does all model work and hands
results back through ``loop.call_soon_threadsafe``. Bad input is a 400 with SGLang's error body
(``{"error": {"message": ...}}``, plus OpenAI-style ``object``/``type``/``code``), never a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from slime_server.config import parse_cpu_list
from slime_server.lora_format import AdapterError
from slime_server.rollout import engine_routes
from slime_server.rollout.cpu_engine import BadRequest, CPUEngine, EngineConfig
from slime_server.rollout.engine_auth import KEY_ENV, InsecureEngineError, add_api_keys, check_exposure
from slime_server.rollout.engine_lora_routes import add_lora_routes
from slime_server.rollout.engine_sequence import Sequence
from slime_server.rollout.engine_weights import add_weight_routes
from slime_server.rollout.grammar import grammar_key
from slime_server.rollout.protocol import (
    AbortReq,
    ErrorBody,
    GenerateOutput,
    GenerateReqInput,
    LoadSnapshot,
    LoadsResponse,
    PauseGenerationReqInput,
    SamplingParams,
)
from slime_server.utils.affinity import pin_process
from slime_server.utils.net import ENGINE_KEEP_ALIVE_S

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
SERVER_VERSION = "slime-server-cpu-engine/0.1"
DISCONNECT_POLL_S = 1.0
HEALTH_GENERATE_TIMEOUT_S = 20.0


def error_response(message: str, status: int = 400) -> JSONResponse:
    body = ErrorBody(error=ErrorBody.Detail(message=message, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


async def parse_body(request: Request, model: type[M], allow_empty: bool = False) -> M:
    """Read and validate a JSON body; every failure becomes a BadRequest (400)."""
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return model.model_validate({})
        raise BadRequest("request body must be a JSON object")
    try:  # parsed and validated in one pass (pydantic-core): a 75k-token prompt in 1.7 ms, not 3.5 (json + validate)
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0] if e.error_count() else {}
        if first.get("type") == "json_invalid":
            raise BadRequest(f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}") from None
        if first.get("type") == "model_type" and not first.get("loc"):
            raise BadRequest("request body must be a JSON object") from None
        raise BadRequest(_validation_message(e)) from None


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """SGLang lets per-request fields be a scalar (shared) or a list with one entry per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _images_per_prompt(image_data: Any, n: int, batch: bool) -> list[list[str]]:
    """SGLang's shapes of ``image_data``: for one prompt an image or a list of them; for a batch a list with one
    entry a prompt (an image or a list), or one image given to every prompt."""
    if image_data is None:
        return [[] for _ in range(n)]
    if not batch:
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list):
        return [[image_data] for _ in range(n)]
    if len(image_data) != n:
        raise BadRequest("The length of image_data should be equal to the batch size.")
    return [item if isinstance(item, list) else [item] for item in image_data]


class GenerateHandler:
    """Turns one ``/generate`` body into engine sequences and their SGLang-shaped results."""

    def __init__(self, engine: CPUEngine) -> None:
        self.engine = engine

    def build(self, req: GenerateReqInput) -> list[Sequence]:
        batch = req.is_batch
        if req.input_ids is not None:
            prompts: list[list[int]] = req.input_ids if batch else [req.input_ids]  # type: ignore[list-item]
        else:
            texts = req.text if isinstance(req.text, list) else [req.text]
            prompts = [self.engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        if not prompts:
            raise BadRequest("input_ids must not be empty")
        n = len(prompts)
        params: list[SamplingParams] = _per_item(req.sampling_params, n, "sampling_params")
        rids = _per_item(req.rid, n, "rid")
        want_lp = _per_item(req.return_logprob, n, "return_logprob")
        tops = _per_item(req.top_logprobs_num, n, "top_logprobs_num")
        starts = _per_item(req.logprob_start_len, n, "logprob_start_len")
        adapters = [self._adapter(name) for name in _per_item(req.lora_path, n, "lora_path")]
        if batch and req.rid is not None and not isinstance(req.rid, list):
            rids = [f"{req.rid}_{i}" for i in range(n)]  # SGLang's names for a batch under one rid
        named = [r for r in rids if r is not None]
        if len(set(named)) != len(named):  # SGLang's _validate_rid_uniqueness
            dup = sorted({r for r in named if named.count(r) > 1})
            raise BadRequest(f"Duplicate request IDs detected within the request: {dup}")
        busy = self.engine.rids_in_flight(named)
        if busy:  # SGLang's _init_req_state refuses a rid that names a request still in flight
            raise BadRequest(f"Duplicate request ID detected: {busy[0]}")
        routes = req.return_routed_experts and self.engine.config.enable_return_routed_experts  # else none, as SGLang
        for prompt in prompts if req.return_routed_experts else []:
            error = engine_routes.start_len_error(len(prompt), req.routed_experts_start_len)
            if error:
                raise BadRequest(error)
        images = _images_per_prompt(req.image_data, n, batch)
        # n > 1: new_sequences gives each sample a fresh uuid, as SGLang's tokenizer manager does
        seqs: list[Sequence] = []
        for i, prompt in enumerate(prompts):
            mm = None
            if images[i]:
                prompt, mm = self.engine.prepare_images(prompt, images[i])
            self.engine.validate(prompt, params[i], tops[i], starts[i])
            seqs += self.engine.new_sequences(prompt, params[i], rid=rids[i], return_logprob=bool(want_lp[i]),
                                              top_logprobs_num=int(tops[i]), logprob_start_len=int(starts[i]),
                                              stream=req.stream, logprob_text=req.return_text_in_logprobs,
                                              lora=adapters[i], return_routed_experts=routes,
                                              routed_experts_start_len=req.routed_experts_start_len, images=mm,
                                              return_prompt_token_ids=req.return_prompt_token_ids)
        return seqs

    def _adapter(self, name: str | None) -> Any:
        """The adapter a prompt's ``lora_path`` names (None: the base), as SGLang resolves and refuses it; one
        unloaded or evicted earlier is loaded again first."""
        if name is None:
            return None
        if self.engine.adapters is None:
            raise BadRequest(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                             "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                             "endpoint.")
        try:
            return self.engine.adapters.resolve(name)
        except AdapterError as e:
            raise BadRequest(str(e)) from None

    async def run(self, req: GenerateReqInput, request: Request) -> Response:
        # naming an adapter may load it (one unloaded or evicted), images are decoded and resized: off the event loop
        slow = req.lora_path is not None or req.image_data is not None
        seqs = await asyncio.to_thread(self.build, req) if slow else self.build(req)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, GenerateOutput | None]] = asyncio.Queue()
        many = req.is_batch or len(seqs) > 1

        def hook(i: int):
            def on_update(seq: Sequence) -> None:  # scheduler thread: snapshot now, deliver on the loop
                snap = self.engine.result(seq) if seq.stream or seq.finish is not None else None
                loop.call_soon_threadsafe(queue.put_nowait, (i, snap))
            return on_update

        if any(grammar_key(s.params) is not None for s in seqs):
            await asyncio.to_thread(self.engine.attach_grammars, seqs)  # compiling a new schema takes a while
        for i, s in enumerate(seqs):
            s.on_update = hook(i)
            self.engine.submit(s)
        if req.stream:
            return StreamingResponse(self._stream(seqs, queue, many), media_type="text/event-stream")
        results: list[GenerateOutput | None] = [None] * len(seqs)
        try:
            while any(r is None for r in results):
                try:
                    i, snap = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():  # SGLang aborts requests whose client left
                        break
                    continue
                if snap is not None and snap.meta_info.finish_reason is not None:
                    results[i] = snap
            else:
                outs = [r.wire() for r in results if r is not None]
                return JSONResponse(outs if many else outs[0])
        finally:
            self.engine.cancel(seqs)  # no-op when all finished; else the client left: free the engine
        return Response(status_code=499)  # client closed the request; nobody reads this

    async def _stream(self, seqs: list[Sequence], queue: asyncio.Queue, many: bool) -> AsyncIterator[bytes]:
        pending = set(range(len(seqs)))
        try:
            while pending:
                i, snap = await queue.get()
                if snap is None:
                    continue
                if many:
                    snap.index = i
                yield b"data: " + json.dumps(snap.wire()).encode() + b"\n\n"
                if snap.meta_info.finish_reason is not None:  # the snapshot, not the live seq: no race
                    pending.discard(i)
            yield b"data: [DONE]\n\n"
        finally:
            self.engine.cancel(seqs)


def create_app(engine: CPUEngine, served_model_name: str | None = None,
               health_timeout_s: float = HEALTH_GENERATE_TIMEOUT_S, api_key: str | None = None,
               admin_api_key: str | None = None) -> FastAPI:
    """The FastAPI app around ``engine`` (the caller owns the engine's lifetime), guarded by SGLang's key rule."""
    app = FastAPI(title="slime-server CPU engine (SGLang protocol)")
    add_api_keys(app, api_key, admin_api_key)
    handler = GenerateHandler(engine)
    counters = {"generate": 0}

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, e: BadRequest) -> JSONResponse:
        return error_response(str(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(str(e))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's rule: healthy once the scheduler makes any progress within the timeout (a busy engine
        needs no probe of its own); a paused engine makes none, so it answers 503 after the timeout."""
        tic = time.monotonic()
        if not engine.paused and engine.load()["num_running_reqs"] == 0:
            probe = SamplingParams(max_new_tokens=1, temperature=0.0)
            seq = engine.new_sequences([0], probe, rid=f"health-{time.monotonic_ns()}")[0]
            engine.submit(seq)
        while time.monotonic() < tic + health_timeout_s:
            if engine.last_progress > tic:
                return Response(status_code=200)
            await asyncio.sleep(0.05)
        return error_response("the engine made no progress in time", status=503)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        counters["generate"] += 1
        req = await parse_body(request, GenerateReqInput)
        return await handler.run(req, request)

    @app.get("/get_model_info")
    @app.get("/model_info")  # newer SGLang name; sgl-router asks for it first
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": engine.config.model_path, "tokenizer_path": engine.config.model_path,
                "served_model_name": served_model_name or engine.config.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        return {**engine.config.model_dump(), "tp_size": 1, "dp_size": 1, "context_length": engine.context_length,
                "max_total_num_tokens": engine.max_total_tokens, "vocab_size": engine.vocab_size,
                "weight_version": engine.weight_version, "version": SERVER_VERSION,
                "num_generate_requests": counters["generate"],
                "internal_states": [{**engine.stats, **engine.load(), "paused": engine.paused,
                                     "torch_threads": engine.threads.threads, "cpus": sorted(os.sched_getaffinity(0)),
                                     "decode_kernel_target": engine.kernel_target}]}

    @app.get("/v1/loads", response_model=LoadsResponse)
    async def v1_loads() -> LoadsResponse:
        """SGLang 0.5.23's load route: one ``LoadSnapshot`` per DP rank (its core fields this engine has)."""
        load = engine.load()
        return LoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=SERVER_VERSION,
            loads=[LoadSnapshot(num_running_reqs=load["num_running_reqs"], num_waiting_reqs=load["num_waiting_reqs"],
                                max_running_requests=engine.config.max_running_requests,
                                max_total_num_tokens=engine.max_total_tokens)])

    @app.get("/get_load")  # what sgl-router 0.3.2 polls (SGLang 0.5.23 no longer serves it)
    async def get_load() -> list[dict[str, int]]:
        load = engine.load()
        return [{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                 "num_waiting_reqs": load["num_waiting_reqs"]}]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not engine.flush_cache():  # SGLang's rule and answer when requests are running or queued
            return PlainTextResponse("Flush cache failed.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    @app.api_route("/get_weight_version", methods=["GET", "POST"])
    async def get_weight_version() -> dict[str, str]:
        """Alias kept for old clients (SGLang 0.5.15 deprecated it, 0.5.23 removed it): use /model_info."""
        return {"weight_version": engine.weight_version}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await parse_body(request, AbortReq)
        if not req.rid and not req.abort_all:
            raise BadRequest("give 'rid' or 'abort_all': true")
        engine.abort(req.rid or "", req.abort_all)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        req = await parse_body(request, PauseGenerationReqInput, allow_empty=True)
        await asyncio.to_thread(engine.pause, req.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, str]:
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    app.state.weight_updates = add_weight_routes(app, engine, parse_body)
    add_lora_routes(app, engine, parse_body, served_model_name or engine.config.model_path)
    return app


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="CPU inference engine speaking SGLang's HTTP protocol")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=0,
                    help="torch threads (default 0: one per core the engine may run on, followed as it changes)")
    ap.add_argument("--cpus", type=parse_cpu_list, default=None,
                    help="run on these cores only (taskset's list syntax, e.g. 0-3,6; default: any)")
    ap.add_argument("--prefix-cache-mb", type=float, default=512.0,
                    help="MiB of finished generations' K/V kept for prompts that extend them (0: off)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="bfloat16 halves the memory read per token where the CPU has native bf16")
    ap.add_argument("--forward", choices=["lean", "hf"], default="lean",
                    help="lean: the engine's own forward (llama/mistral/qwen2/qwen3); hf: HF's model() (reference)")
    ap.add_argument("--decode-kernel", choices=["c", "torch"], default="c",
                    help="c: decode matmuls through the engine's C kernel, built for this CPU on first use "
                    "(SLIME_CPU_ISA caps its instruction set); torch: torch's kernels throughout")
    ap.add_argument("--grammar-backend", choices=["xgrammar", "none"], default="xgrammar",
                    help="as SGLang's: what compiles sampling_params' json_schema / regex / ebnf / structural_tag")
    ap.add_argument("--constrained-json-disable-any-whitespace", action="store_true",
                    help="as SGLang's: JSON under a schema is compact")
    ap.add_argument("--constrained-json-max-whitespace-cnt", type=int, default=None,
                    help="as SGLang's: at most this many whitespace characters in a row in constrained JSON")
    ap.add_argument("--enable-lora", action="store_true", help="as SGLang's: serve LoRA adapters (lean forward)")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="as SGLang's (default: the largest of "
                    "--lora-paths, else 64)")
    ap.add_argument("--lora-target-modules", nargs="*", default=None, help="as SGLang's: q_proj ... down_proj, "
                    "qkv_proj, gate_up_proj, or all (default)")
    ap.add_argument("--lora-paths", nargs="*", default=[], help="as SGLang's: PATH, NAME=PATH or "
                    "'{\"lora_name\": ..., \"lora_path\": ..., \"pinned\": ...}', loaded at start")
    ap.add_argument("--max-loras-per-batch", type=int, default=8, help="as SGLang's: adapters in one batch, "
                    "the base counting as one")
    ap.add_argument("--max-loaded-loras", type=int, default=None, help="as SGLang's: adapters loaded at once "
                    "(the least recently used unpinned one is unloaded to make room)")
    ap.add_argument("--enable-return-routed-experts", action="store_true", help="as SGLang's: an MoE model's "
                    "answers carry each token's routed experts when a request asks (return_routed_experts)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--health-check-timeout", type=float, default=HEALTH_GENERATE_TIMEOUT_S,
                    help="/health_generate waits this long for scheduler progress (SGLang: 20 s)")
    ap.add_argument("--api-key", default=None, help="as SGLang's: every route but /health*, /ready, /metrics "
                    "needs 'Authorization: Bearer KEY'")
    ap.add_argument("--admin-api-key", default=None, help="as SGLang's: the admin routes (weight updates, pause, "
                    "abort, flush) need this key instead")
    ap.add_argument("--insecure-engines", action="store_true", help="start on a non-loopback --host with no "
                    "--api-key (anyone on the network may then swap weights); refused otherwise")
    ap.add_argument("--log-level", default="warning")
    return ap


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.cpus:  # before the engine starts torch's threads, so they inherit it
        try:
            pin_process(args.cpus)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    api_key = args.api_key or os.environ.get(KEY_ENV) or None
    try:
        exposed = check_exposure(args.host, api_key or args.admin_api_key, args.insecure_engines)
    except InsecureEngineError as e:
        raise SystemExit(f"error: {e}") from None
    if exposed:
        log.warning("engine on %s:%d has no API key (--insecure-engines): anyone who reaches it can replace its "
                    "weights or abort its requests", args.host, args.port)
    config = EngineConfig(model_path=args.model_path, max_running_requests=args.max_running_requests,
                          max_total_tokens=args.max_total_tokens, context_length=args.context_length,
                          weight_version=args.weight_version, seed=args.seed, num_threads=args.num_threads,
                          forward=args.forward, prefix_cache_mb=args.prefix_cache_mb, dtype=args.dtype,
                          decode_kernel=args.decode_kernel, grammar_backend=args.grammar_backend,
                          constrained_json_disable_any_whitespace=args.constrained_json_disable_any_whitespace,
                          constrained_json_max_whitespace_cnt=args.constrained_json_max_whitespace_cnt,
                          enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
                          lora_target_modules=args.lora_target_modules, lora_paths=args.lora_paths,
                          max_loras_per_batch=args.max_loras_per_batch, max_loaded_loras=args.max_loaded_loras,
                          enable_return_routed_experts=args.enable_return_routed_experts)
    engine = CPUEngine(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = create_app(engine, args.served_model_name, health_timeout_s=args.health_check_timeout,
                     api_key=api_key, admin_api_key=args.admin_api_key)
    app.router.lifespan_context = lifespan
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                timeout_keep_alive=ENGINE_KEEP_ALIVE_S)  # as SGLang's (clients expire idle connections first)


if __name__ == "__main__":
    main()
