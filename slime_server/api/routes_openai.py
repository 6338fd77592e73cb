"""OpenAI routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header
from fastapi.responses import StreamingResponse

from slime_server.api import openai_chat
from slime_server.api.deps import get_gateway, get_principal
from slime_server.gateway import recording, routes
from slime_server.gateway import turn as core
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import bad_request
from slime_server.gateway.principal import Principal
from slime_server.gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    Usage,
    new_id,
)
from slime_server.gateway.sessions_resolve import resolve_session
from slime_server.gateway.threads import in_thread
from slime_server.gateway.token_text import incomplete_utf8_tail

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 409, 413, 502, 503)}

router = APIRouter(prefix="/v1", responses=ERRORS)

GW = Annotated[Gateway, Depends(get_gateway)]
Caller = Annotated[Principal, Depends(get_principal)]
SessionHeader = Annotated[str | None, Header(alias="X-Session-Id", max_length=200)]
TurnTypeHeader = Annotated[Literal["main", "side"] | None, Header(
    alias="X-Turn-Type", description="main (default) | side: served, recorded, never trained")]


@router.get("/models", response_model=ModelList, response_model_exclude_none=True)
async def list_models(gw: GW, _: Caller) -> ModelList:
    """The served model, then each LoRA adapter the engines serve as ``<served>:<adapter>`` (its ``parent``): a
    published alias by its alias, its versions not listed apart."""
    adapters = await gw.adapters.listing()
    return ModelList(data=[ModelCard(id=gw.model_name),
                           *(ModelCard(id=f"{gw.model_name}:{a}", parent=gw.model_name) for a in adapters)])


@router.get("/models/{model_id}", response_model=ModelCard, response_model_exclude_none=True)
async def get_model(model_id: str, gw: GW, principal: Caller) -> ModelCard:
    adapter = core.check_model(gw, model_id)
    if adapter is None:
        return ModelCard(id=gw.model_name)
    await gw.adapters.for_call(adapter, principal)
    return ModelCard(id=model_id, parent=gw.model_name)


@router.post("/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
async def chat_completions(req: ChatCompletionRequest, gw: GW, principal: Caller,
                           x_session_id: SessionHeader = None, x_turn_type: TurnTypeHeader = None):
    core.validate_chat(gw, req)
    openai_chat.check_tool_images(req)
    side = core.is_side_turn(x_turn_type, req.metadata)
    if not req.stream:
        return await openai_chat.chat_completion(gw, req, principal, x_session_id, side=side)
    turn, call = await openai_chat.chat_stream(gw, req, principal, x_session_id, side=side)
    return StreamingResponse(openai_chat.stream_events(gw, turn, call), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/completions", response_model=CompletionResponse)
async def completions(req: CompletionRequest, gw: GW, principal: Caller,
                      x_session_id: SessionHeader = None) -> CompletionResponse:
    """Raw completion; recorded as a one-turn trajectory (the prompt is context, the output generated)."""
    adapter = core.check_model(gw, req.model)
    route = await gw.adapters.for_call(adapter, principal)
    if req.stream:
        raise bad_request("stream is not supported on /v1/completions; use /v1/chat/completions", param="stream")
    if req.n > gw.settings.max_n:
        raise bad_request(f"n must be <= {gw.settings.max_n}", param="n")
    core.check_penalties(gw, req.frequency_penalty, req.presence_penalty)
    if isinstance(req.prompt, str):
        if not req.prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        prompt_ids = await in_thread(gw.renderer.encode, req.prompt)
    else:
        prompt_ids = list(req.prompt)
    vocab = len(gw.renderer.tokenizer)
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
    params = core.sampling_params(
        gw, prompt_len=len(prompt_ids), max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=None, min_p=None, stop=req.stop, seed=req.seed, n=req.n, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty)
    session_id = resolve_session(principal, x_session_id, req.metadata)
    await gw.admit(session_id, req.metadata)
    prepared = await recording.prepare_raw(gw.store, session_id, prompt_ids, req.n, owner=principal.session_owner)
    response_id = new_id("cmpl")
    outs = await gw.generate(prepared.session_id, response_id, prompt_ids, params, return_logprob=True,
                             top_logprobs_num=req.logprobs or 0, route=route, **routes.request_fields(gw, prepared))
    completion = sum(len(o.output_ids) for o in outs)
    usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                  total_tokens=len(prompt_ids) + completion)
    texts = [core.answer_text(gw, o) for o in outs]
    answered_by = route.name if route is not None else None
    outcomes = [core.outcome(o, i, ResponseMessage(content=t), lora_adapter=answered_by,
                             routed_experts=routes.answer_routes(gw, o, len(prompt_ids), prepared.routes_start))
                for i, (o, t) in enumerate(zip(outs, texts, strict=True))]
    await recording.commit_turn(gw.sessions, prepared, outcomes, response_id, usage)
    choices = []
    for i, o in enumerate(outs):
        reason = o.meta_info.finish_reason.type if o.meta_info.finish_reason else "stop"
        choices.append(CompletionChoice(index=i, text=texts[i], finish_reason="length" if reason == "length" else "stop",
                                        logprobs=_completion_logprobs(gw, o) if req.logprobs is not None else None))
    return CompletionResponse(id=response_id, model=gw.model_name, choices=choices, usage=usage)


def _completion_logprobs(gw: Gateway, out) -> CompletionLogprobs:
    entries = core.token_logprobs(gw, out)
    offsets, seen = [], b""
    for e in entries:  # characters before each token: whole characters of the bytes before it
        offsets.append(len(seen[: len(seen) - incomplete_utf8_tail(seen)].decode("utf-8", "replace")))
        seen += bytes(e.bytes or [])
    tops = [{t.token: t.logprob for t in e.top_logprobs} for e in entries]
    return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=tops if any(tops) else None, text_offset=offsets)

