"""Anthropic routes: ``POST /v1/messages`` (plain and streamed) and ``POST /v1/messages/count_tokens``.

Sessions: ``X-Session-Id``, else Claude Code's ``X-Claude-Code-Session-Id`` (one agent run is one
session without any configuration), else the per-session key's session; none makes a one-turn
session, as on Chat Completions. Keys come as ``x-api-key`` or ``Authorization: Bearer``. Errors
under these paths are in Anthropic's format (errors.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header
from fastapi.responses import StreamingResponse

from slime_server.api import anthropic_messages as am
from slime_server.api.anthropic_protocol import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    new_message_id,
)
from slime_server.api.deps import get_gateway, get_principal
from slime_server.gateway.core import Gateway
from slime_server.gateway.images import TurnImages, image_reader
from slime_server.gateway.principal import Principal
from slime_server.gateway.recording import call_store
from slime_server.gateway.threads import in_thread
from slime_server.gateway.turn import ChatTurn, check_model, is_side_turn, validate_chat

ERRORS = {status: {"model": AnthropicError} for status in (400, 401, 403, 404, 409, 413, 429, 502, 503)}

router = APIRouter(prefix="/v1", responses=ERRORS, tags=["anthropic"])

GW = Annotated[Gateway, Depends(get_gateway)]
Caller = Annotated[Principal, Depends(get_principal)]
SessionHeader = Annotated[str | None, Header(alias="X-Session-Id", max_length=200)]
ClaudeCodeSession = Annotated[str | None, Header(alias="X-Claude-Code-Session-Id", max_length=200)]
TurnTypeHeader = Annotated[Literal["main", "side"] | None, Header(
    alias="X-Turn-Type", description="main (default) | side: served, recorded, never trained")]


@router.post("/messages", response_model=MessageResponse, response_model_exclude_none=False,
             responses={200: {"content": {"text/event-stream": {}}}})
async def create_message(req: MessagesRequest, gw: GW, principal: Caller, x_session_id: SessionHeader = None,
                         x_claude_code_session_id: ClaudeCodeSession = None,
                         x_turn_type: TurnTypeHeader = None):
    if getattr(gw.renderer, "vision", None) is None:
        am.refuse_images(req.messages)
    chat = am.to_chat_request(req)
    validate_chat(gw, chat)
    side = is_side_turn(x_turn_type, None)
    turn = ChatTurn(gw, chat, side=side, response_id=new_message_id())
    call = await turn.prepare(principal, x_session_id or x_claude_code_session_id)
    if not req.stream:
        result = await turn.run(call)  # durable before we answer
        return am.message_response(turn, result, req.model)
    return StreamingResponse(am.stream_events(turn, call, req.model), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/messages/count_tokens", response_model=CountTokensResponse)
async def count_tokens(req: CountTokensRequest, gw: GW, _: Caller) -> CountTokensResponse:
    """The prompt's token count as this server would render it (no session, nothing recorded)."""
    check_model(gw, req.model)
    vision = getattr(gw.renderer, "vision", None)
    if vision is None:
        am.refuse_images(req.messages)
    messages = am.system_messages(req.system) + am.chat_messages(req.messages)
    messages = await image_reader(gw).canonical(messages, TurnImages())
    tools = am.chat_tools(req.tools)
    ids = await in_thread(call_store, gw.renderer.render_ids, messages, tools)
    # each image renders as one pad; the engine sees it expanded
    pads = sum(p["tokens"] - 1 for m in messages if isinstance(m.get("content"), list) for p in m["content"]
               if p.get("type") == "image")
    return CountTokensResponse(input_tokens=len(ids) + pads)
