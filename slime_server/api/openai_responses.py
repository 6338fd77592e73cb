"""OpenAI Responses over the one turn core: input items -> canonical chat request -> output items / SSE.

Translation:
- ``instructions`` is the system message (not carried over from ``previous_response_id``, as OpenAI
  documents); message items keep their role (``developer`` is the system role);
- ``reasoning`` items become the next assistant message's ``reasoning_content``, ``function_call``
  items that assistant message's tool calls, ``function_call_output`` items tool messages;
- ``previous_response_id``: the stored chain (each response keeps only its own new input and its
  output) is replayed in front of the new input, in the same session, so the session layer extends
  the same trajectory with the model's exact tokens (nothing it already saw is re-rendered);
- answers: a ``reasoning`` item, a ``message`` item with one ``output_text`` part, one
  ``function_call`` item per parsed call; ``incomplete`` with ``max_output_tokens`` when cut.
Streams emit OpenAI's event sequence with ``sequence_number``s; the turn is recorded, and the response
stored, before ``response.completed``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from slime_server.api.responses_protocol import (
    FunctionToolChoice,
    IncompleteDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    new_item_id,
)
from slime_server.buffer.schema import StoredResponse
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import APIError, bad_request
from slime_server.gateway.images import by_reference
from slime_server.gateway.principal import Principal
from slime_server.gateway.protocol import ChatCompletionRequest, DeltaMessage, ResponseMessage
from slime_server.gateway.recording import call_store
from slime_server.gateway.threads import in_thread
from slime_server.gateway.turn import ChatTurn, TurnResult, canonical_request, engine_reason
from slime_server.gateway.turn_stream import StreamDelta, turn_events

MAX_CHAIN = 10_000  # previous_response_id links followed at most (a cycle cannot be built, but a bound is cheap)


# ----------------------------------------------------------------------------- input -> chat messages


def _parts_text(content: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    """Input parts as chat content: one string when all are text; with ``input_image`` parts, chat parts in order
    (``ImageReader`` reads each image)."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if part.type in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.text})
        elif part.type == "refusal":
            parts.append({"type": "text", "text": part.refusal})
        elif part.type == "input_image":
            url = part.image_url
            if not url:
                raise bad_request(f"{where}[{i}]: an input_image needs image_url (this server has no Files API for "
                                  "file_id)", param=f"{where}[{i}]")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_request(f"{where}[{i}]: {part.type} content is not supported by this server",
                              param=f"{where}[{i}]")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def refuse_images(items: str | list[Any]) -> None:
    """For a text-only model: the first ``input_image`` is a 400 naming where it is in the request."""
    if isinstance(items, str):
        return
    for i, item in enumerate(items):
        content, where = ((item.content, f"input[{i}].content") if item.type == "message" else
                          (item.output, f"input[{i}].output") if item.type == "function_call_output" else (None, ""))
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.type == "input_image":
                raise bad_request(f"{where}[{j}]: input_image content is not supported by this text-only model",
                                  param=f"{where}[{j}]", code="images_not_supported")


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Input items -> OpenAI chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, Any]:
        """The assistant message function calls join: the last message if it is one (and has no results yet)."""
        if out and out[-1]["role"] == "assistant" and not reasoning:
            return out[-1]
        out.append({"role": "assistant", "content": ""})
        take_reasoning(out[-1])
        return out[-1]

    def take_reasoning(msg: dict[str, Any]) -> None:
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            msg = {"role": item.role, "content": _parts_text(item.content, f"{where}.content")}
            if item.role == "assistant":
                take_reasoning(msg)
            out.append(msg)
        elif item.type == "reasoning":
            parts = item.content if item.content else item.summary
            reasoning.append("".join(p.text for p in parts))
        elif item.type == "function_call":
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif item.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _parts_text(item.output, f"{where}.output")})
        else:
            raise bad_request(f"{where}: {item.type} items are not supported by this server", param=where)
    return out


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
             for t in req.tools or [] if t.type == "function"]
    return tools or None


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]], new: list[dict[str, Any]]) -> ChatCompletionRequest:
    fmt = req.text.format if req.text else None
    response_format: dict[str, Any] | None = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":  # Responses flattens Chat's json_schema object
        extra = fmt.model_extra or {}
        response_format = {"type": "json_schema", "json_schema": {
            k: extra[k] for k in ("name", "schema", "strict", "description") if k in extra}}
    tools = chat_tools(req)
    choice: Any = req.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    if not tools and choice in ("auto", "none"):
        choice = None
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body = {"model": req.model, "messages": system + history + new, "tools": tools, "tool_choice": choice,
            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "metadata": req.metadata, "response_format": response_format}
    return canonical_request(body)


# ----------------------------------------------------------------------------- the stored chain


def _may_read(principal: Principal, stored: StoredResponse) -> bool:
    return principal.may_access(SimpleNamespace(id=stored.session_id, owner=stored.owner))


async def load_stored(gw: Gateway, principal: Principal, response_id: str, param: str | None = None) -> StoredResponse:
    """A stored response the caller may read, else 404 (another key's responses do not exist for it)."""
    missing = APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found", param=param)
    try:
        stored = await in_thread(call_store, gw.store.get_stored_response, response_id)
    except APIError as e:
        if e.status == 404:
            raise missing from None
        raise
    if not _may_read(principal, stored):
        raise missing
    return stored


async def history(gw: Gateway, principal: Principal, previous_id: str) -> tuple[StoredResponse, list[dict[str, Any]]]:
    """The conversation up to and including ``previous_id``'s output, oldest first."""
    head = await load_stored(gw, principal, previous_id, param="previous_response_id")
    chain, node = [head], head
    while node.previous_response_id is not None and len(chain) < MAX_CHAIN:
        node = await load_stored(gw, principal, node.previous_response_id, param="previous_response_id")
        chain.append(node)
    messages: list[dict[str, Any]] = []
    for rec in reversed(chain):
        messages += list(rec.body.get("input", [])) + [rec.body["output"]]
    return head, messages


async def store_response(gw: Gateway, turn: ChatTurn, principal: Principal, req: ResponsesRequest,
                         new: list[dict[str, Any]], response: ResponseObject) -> None:
    message = turn_message(response)
    stored = StoredResponse(id=response.id, session_id=turn.prepared.session_id, owner=principal.session_owner,
                            previous_response_id=req.previous_response_id,
                            body={"input": by_reference(new, turn.images), "output": message,
                                  "response": response.model_dump()})
    await in_thread(call_store, gw.store.put_stored_response, stored)


def turn_message(response: ResponseObject) -> dict[str, Any]:
    """The assistant chat message a response's output items stand for (what the next turn replays)."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in response.output:
        if isinstance(item, OutputReasoning):
            msg["reasoning_content"] = "".join(p.text for p in item.content)
        elif isinstance(item, OutputMessage):
            msg["content"] = "".join(p.text for p in item.content)
        else:
            msg.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    return msg


# ----------------------------------------------------------------------------- answer


def output_items(message: ResponseMessage, incomplete: bool) -> list[OutputItem]:
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(OutputReasoning(id=new_item_id("rs"), content=[OutputReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(OutputMessage(id=new_item_id("msg"), status="incomplete" if incomplete else "completed",
                                   content=[OutputText(text=message.content)]))
    for call in message.tool_calls or []:
        items.append(OutputFunctionCall(id=new_item_id("fc"), call_id=call.id, name=call.function.name,
                                        arguments=call.function.arguments))
    return items


def is_incomplete(result: TurnResult) -> bool:
    return engine_reason(result.outs[0]) == "length" and not result.messages[0].tool_calls


def response_object(req: ResponsesRequest, response_id: str, **fields: Any) -> ResponseObject:
    """The response envelope echoing the request's settings (OpenAI returns them with every response)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionToolChoice) else (req.tool_choice or "auto")
    return ResponseObject(id=response_id, model=req.model, instructions=req.instructions,
                          max_output_tokens=req.max_output_tokens, previous_response_id=req.previous_response_id,
                          store=req.store, temperature=req.temperature, top_p=req.top_p, tools=tools, tool_choice=choice,
                          parallel_tool_calls=req.parallel_tool_calls is not False, metadata=req.metadata or {},
                          user=req.user, **fields)


def finished(req: ResponsesRequest, response_id: str, result: TurnResult, output: list[OutputItem]) -> ResponseObject:
    u = result.usage
    incomplete = is_incomplete(result)
    return response_object(
        req, response_id, status="incomplete" if incomplete else "completed", output=output,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        usage=ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens))


# ----------------------------------------------------------------------------- stream


class EventWriter:
    """Responses stream events: ``sequence_number``s, one open output item at a time, its done events."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: str | None = None

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, kind: str, item: OutputItem) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open = kind
        added = item.model_dump()
        if kind == "message":
            added.update(status="in_progress", content=[])
        elif kind == "function_call":
            added.update(status="in_progress", arguments="")
        else:
            added.update(content=[])
        events.append(self.event("response.output_item.added", output_index=self._index, item=added))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=self._index,
                                     content_index=0, part=OutputText(text="").model_dump()))
        elif kind == "reasoning":
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=self._index,
                                     content_index=0, part=OutputReasoningText(text="").model_dump()))
        return events

    def close(self, incomplete: bool = False) -> list[str]:
        if self.open is None:
            return []
        item, i, kind = self.items[-1], self._index, self.open
        self.open = None
        events = []
        if isinstance(item, OutputMessage):
            if incomplete:
                item.status = "incomplete"
            part = item.content[0]
            events += [self.event("response.output_text.done", item_id=item.id, output_index=i, content_index=0,
                                  text=part.text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item.id, output_index=i, content_index=0,
                                  part=part.model_dump())]
        elif isinstance(item, OutputReasoning):
            part = item.content[0]
            events += [self.event("response.reasoning_text.done", item_id=item.id, output_index=i, content_index=0,
                                  text=part.text),
                       self.event("response.content_part.done", item_id=item.id, output_index=i, content_index=0,
                                  part=part.model_dump())]
        elif kind == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=i,
                                     name=item.name, arguments=item.arguments))
        events.append(self.event("response.output_item.done", output_index=i, item=item.model_dump()))
        return events

    def feed(self, delta: DeltaMessage) -> list[str]:
        events: list[str] = []
        if delta.reasoning_content:
            if self.open != "reasoning":
                events += self._start("reasoning", OutputReasoning(id=new_item_id("rs"),
                                                                   content=[OutputReasoningText(text="")]))
            item = self.items[-1]
            item.content[0].text += delta.reasoning_content
            events.append(self.event("response.reasoning_text.delta", item_id=item.id, output_index=self._index,
                                     content_index=0, delta=delta.reasoning_content))
        if delta.content:
            if self.open != "message":
                events += self._start("message", OutputMessage(id=new_item_id("msg"), content=[OutputText(text="")]))
            item = self.items[-1]
            item.content[0].text += delta.content
            events.append(self.event("response.output_text.delta", item_id=item.id, output_index=self._index,
                                     content_index=0, delta=delta.content, logprobs=[]))
        for call in delta.tool_calls or []:
            if call.id is not None:
                events += self._start("function_call", OutputFunctionCall(
                    id=new_item_id("fc"), call_id=call.id, name=call.function.name or "", arguments=""))
            if call.function.arguments:
                item = self.items[-1]
                item.arguments += call.function.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                         output_index=self._index, delta=call.function.arguments))
        return events


async def stream_events(gw: Gateway, turn: ChatTurn, call: dict[str, Any], principal: Principal,
                        req: ResponsesRequest, new: list[dict[str, Any]]) -> AsyncIterator[str]:
    """created, in_progress, items as they grow, (record, store), completed / incomplete; failed on error."""
    w = EventWriter()
    started = response_object(req, turn.response_id, status="in_progress").model_dump()
    yield w.event("response.created", response=started)
    yield w.event("response.in_progress", response=started)
    try:
        async for event in turn_events(gw, turn, call):
            if isinstance(event, StreamDelta):
                for line in w.feed(event.delta):
                    yield line
                continue
            incomplete = is_incomplete(event.result)
            for line in w.feed(event.finals[0]) + w.close(incomplete):
                yield line
            response = finished(req, turn.response_id, event.result, w.items)
            if req.store:
                await store_response(gw, turn, principal, req, new, response)
            yield w.event("response.incomplete" if incomplete else "response.completed", response=response.model_dump())
    except APIError as e:
        failed = response_object(req, turn.response_id, status="failed", output=w.items,
                                 error={"code": e.code or "server_error", "message": e.message})
        yield w.event("response.failed", response=failed.model_dump())
