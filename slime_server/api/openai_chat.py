"""``/v1/chat/completions``: the OpenAI chat request -> one turn (gateway/turn.py) -> the chat answer or its SSE."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import APIError, bad_request
from slime_server.gateway.principal import Principal
from slime_server.gateway.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
    DeltaMessage,
    Usage,
)
from slime_server.gateway.turn import ChatTurn, token_logprobs
from slime_server.gateway.turn_stream import StreamDelta, turn_events


def check_tool_images(req: ChatCompletionRequest) -> None:
    """OpenAI's Chat Completions takes only text in a tool message (its ``ChatCompletionToolMessageParam``); an image a
    tool returns goes in a user message after it (Responses' ``function_call_output`` and Messages' ``tool_result``
    carry images themselves)."""
    for i, m in enumerate(req.messages):
        if m.role == "tool" and isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type == "image_url":
                    where = f"messages[{i}].content[{j}]"
                    raise bad_request(f"{where}: a tool message holds text only in Chat Completions (as OpenAI's API); "
                                      "send the tool's image in a user message after it", param=where)


async def chat_completion(gw: Gateway, req: ChatCompletionRequest, principal: Principal,
                          header_session_id: str | None, *, side: bool = False) -> ChatCompletionResponse:
    turn = ChatTurn(gw, req, side=side)
    call = await turn.prepare(principal, header_session_id)
    result = await turn.run(call)  # durable before we answer
    choices = []
    for i, (o, m, reason) in enumerate(zip(result.outs, result.messages, result.finish_reasons(), strict=True)):
        lp = ChoiceLogprobs(content=token_logprobs(gw, o)) if req.logprobs else None
        choices.append(ChatChoice(index=i, message=m, logprobs=lp, finish_reason=reason))
    return ChatCompletionResponse(id=turn.response_id, model=gw.model_name, choices=choices, usage=result.usage)


def _sse(obj: Any) -> str:
    data = obj.model_dump_json(exclude_none=True) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


async def chat_stream(gw: Gateway, req: ChatCompletionRequest, principal: Principal,
                      header_session_id: str | None, *, side: bool = False) -> tuple[ChatTurn, dict[str, Any]]:
    """Validate and prepare before the HTTP response starts (so errors are real 4xx statuses)."""
    turn = ChatTurn(gw, req, side=side)
    call = await turn.prepare(principal, header_session_id)
    return turn, call


async def stream_events(gw: Gateway, turn: ChatTurn, call: dict[str, Any]) -> AsyncIterator[str]:
    """SSE body: role chunk, deltas, (record), finish chunks, optional usage chunk, ``[DONE]``."""
    req = turn.req

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        return _sse(ChatCompletionChunk(id=turn.response_id, model=gw.model_name, choices=choices, usage=usage))

    yield chunk([ChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(req.n)])
    try:
        async for event in turn_events(gw, turn, call, with_logprobs=req.logprobs):
            if isinstance(event, StreamDelta):
                yield chunk([ChunkChoice(index=event.index, delta=event.delta, logprobs=event.logprobs)])
                continue
            for i, (d, reason) in enumerate(zip(event.finals, event.finish_reasons, strict=True)):
                yield chunk([ChunkChoice(index=i, delta=d, finish_reason=reason)])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], event.usage)
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"
