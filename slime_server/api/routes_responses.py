"""OpenAI Responses routes: ``POST /v1/responses`` (plain and streamed), ``GET /v1/responses/{id}``.

Sessions, first wins: the per-session key's session; ``X-Session-Id``; Codex CLI's ``session_id`` /
``session-id`` header; the session of ``previous_response_id``; ``metadata.session_id``. A stored
response (``store``, the default) with none of these starts a session of its own that later
responses continue; ``store: false`` without a session is a one-turn session, as on Chat Completions.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse

from slime_server.api import openai_responses as orr
from slime_server.api.deps import get_gateway, get_principal
from slime_server.api.responses_protocol import ResponseObject, ResponsesRequest, new_item_id
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import bad_request
from slime_server.gateway.principal import Principal
from slime_server.gateway.protocol import ErrorResponse
from slime_server.gateway.turn import ChatTurn, is_side_turn, validate_chat

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 409, 413, 429, 502, 503)}

router = APIRouter(prefix="/v1", responses=ERRORS, tags=["responses"])

GW = Annotated[Gateway, Depends(get_gateway)]
Caller = Annotated[Principal, Depends(get_principal)]
TurnTypeHeader = Annotated[Literal["main", "side"] | None, Header(
    alias="X-Turn-Type", description="main (default) | side: served, recorded, never trained")]
SESSION_HEADERS = ("x-session-id", "session_id", "session-id")


def header_session(request: Request) -> str | None:
    for name in SESSION_HEADERS:
        value = request.headers.get(name)
        if value:
            return value
    return None


@router.post("/responses", response_model=ResponseObject, responses={200: {"content": {"text/event-stream": {}}}})
async def create_response(req: ResponsesRequest, request: Request, gw: GW, principal: Caller,
                          x_turn_type: TurnTypeHeader = None):
    if getattr(gw.renderer, "vision", None) is None:
        orr.refuse_images(req.input)
    new = orr.input_messages(req.input)
    past: list[dict] = []
    named = header_session(request)
    if req.previous_response_id is not None:
        previous, past = await orr.history(gw, principal, req.previous_response_id)
        if named is not None and named != previous.session_id:
            raise bad_request(f"previous_response_id belongs to another session than '{named}'",
                              param="previous_response_id")
        named = previous.session_id
    chat = orr.to_chat_request(req, past, new)
    validate_chat(gw, chat)
    side = is_side_turn(x_turn_type, req.metadata)
    response_id = new_item_id("resp")
    if named is None and req.store and principal.session_id is None and not (req.metadata or {}).get("session_id"):
        named = f"sess-{response_id}"  # a stored response can be continued: its session must stay open
    turn = ChatTurn(gw, chat, side=side, response_id=response_id)
    call = await turn.prepare(principal, named)
    if req.stream:
        return StreamingResponse(orr.stream_events(gw, turn, call, principal, req, new), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await turn.run(call)  # durable before we answer
    response = orr.finished(req, response_id, result, orr.output_items(result.messages[0], orr.is_incomplete(result)))
    if req.store:
        await orr.store_response(gw, turn, principal, req, new, response)
    return response


@router.get("/responses/{response_id}", response_model=ResponseObject)
async def get_response(response_id: str, gw: GW, principal: Caller) -> ResponseObject:
    stored = await orr.load_stored(gw, principal, response_id)
    return ResponseObject.model_validate(stored.body["response"])
