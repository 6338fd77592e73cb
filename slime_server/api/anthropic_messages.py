"""Anthropic Messages over the one turn core: request -> canonical chat request -> answer / SSE events.

Translation (both ways lossless for what a text model can see):
- ``system`` (string or text blocks) and ``role: "system"`` entries become system messages;
- a user message's ``tool_result`` blocks become tool messages (in order, before its text), its text
  blocks one user message;
- an assistant message's ``thinking`` blocks become ``reasoning_content``, its text blocks the content,
  its ``tool_use`` blocks tool calls (``input`` as JSON; the session layer compares arguments as JSON,
  so the model's own spelling of the arguments keeps its exact tokens);
- tools with ``input_schema`` become function tools; ``tool_choice`` auto/any/tool/none map to
  auto/required/named/none; ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``
  pass to SGLang's sampling parameters.
Answers: a thinking block (the reasoning parser's split), a text block when there is text, one
``tool_use`` block per parsed call; ``stop_reason`` from the engine's finish (``stop_sequence`` names
the matched string). Streams emit each block as it grows, and the turn is recorded before
``message_delta`` / ``message_stop``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from slime_server.api.anthropic_protocol import (
    ContentBlock,
    MessageParam,
    MessageResponse,
    MessagesRequest,
    MessagesUsage,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ToolChoiceParam,
    ToolParam,
    ToolUseBlock,
)
from slime_server.api.errors import anthropic_error_body
from slime_server.gateway.errors import APIError, bad_request
from slime_server.gateway.protocol import ChatCompletionRequest, DeltaMessage, ResponseMessage
from slime_server.gateway.turn import ChatTurn, TurnResult, canonical_request, engine_reason, matched_stop
from slime_server.gateway.turn_stream import StreamDelta, turn_events
from slime_server.rollout.protocol import GenerateOutput

BLOCK_SEPARATOR = "\n\n"  # between text blocks of one message (the model sees one string)


# ----------------------------------------------------------------------------- request -> chat request


def _text(content: str | list[Any] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, block in enumerate(content):
        if block.type != "text":
            raise bad_request(f"{where}[{i}]: {block.type} content is not supported by this text-only model",
                              param=f"{where}[{i}]")
        parts.append(block.text)
    return BLOCK_SEPARATOR.join(parts)


def _parts(content: str | list[Any] | None, where: str) -> str | list[dict[str, Any]]:
    """A user message's or a tool result's blocks: one string when all are text (joined by ``BLOCK_SEPARATOR``);
    with images, chat parts in order (an image block's source as a data URL or its URL; ``ImageReader`` reads it),
    the same separator between blocks."""
    if content is None or isinstance(content, str) or all(b.type == "text" for b in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        if parts:
            parts.append({"type": "text", "text": BLOCK_SEPARATOR})
        if block.type == "text":
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image":
            parts.append({"type": "image_url", "image_url": {"url": image_source(block.source, f"{where}[{i}]")}})
        else:
            raise bad_request(f"{where}[{i}]: {block.type} content is not supported by this server",
                              param=f"{where}[{i}]")
    return parts


def image_source(source: dict[str, Any], where: str) -> str:
    """An image block's ``source``: base64 (with its media type) as a data URL, or a URL."""
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f"{where}.source: an image source is {{type: base64, media_type, data}} or {{type: url, url}}",
                      param=f"{where}.source")


def refuse_images(messages: list[MessageParam]) -> None:
    """For a text-only model: the first image block (in a message or a tool result) is a 400 naming where it is."""
    for i, msg in enumerate(messages):
        for j, block in enumerate(msg.content if isinstance(msg.content, list) else []):
            inner = block.content if block.type == "tool_result" and isinstance(block.content, list) else []
            spots = [(f"messages[{i}].content[{j}]", block)] + [
                (f"messages[{i}].content[{j}].content[{k}]", b) for k, b in enumerate(inner)]
            for where, b in spots:
                if b.type == "image":
                    raise bad_request(f"{where}: image content is not supported by this text-only model",
                                      param=where, code="images_not_supported")


def system_messages(system: str | list[TextBlockParam] | None) -> list[dict[str, Any]]:
    text = _text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages: list[MessageParam]) -> list[dict[str, Any]]:
    """Anthropic messages -> OpenAI chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        if msg.role == "assistant":
            text, reasoning, calls = [], [], []
            for j, block in enumerate(msg.content):
                if block.type == "text":
                    text.append(block.text)
                elif block.type == "thinking":
                    reasoning.append(block.thinking)
                elif block.type == "redacted_thinking":
                    continue
                elif block.type == "tool_use":
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name,
                                               "arguments": json.dumps(block.input, ensure_ascii=False)}})
                else:
                    raise bad_request(f"{where}[{j}]: {block.type} blocks cannot be in an assistant message",
                                      param=f"{where}[{j}]")
            entry: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                entry["reasoning_content"] = "".join(reasoning)
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
            continue
        texts: list[Any] = []
        for j, block in enumerate(msg.content):
            if block.type == "tool_result":
                if msg.role != "user":
                    raise bad_request(f"{where}[{j}]: tool_result blocks belong in user messages",
                                      param=f"{where}[{j}]")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _parts(block.content, f"{where}[{j}].content")})
            elif block.type in ("text", "image"):
                texts.append(block)
            elif block.type in ("thinking", "redacted_thinking", "tool_use"):
                raise bad_request(f"{where}[{j}]: {block.type} blocks belong in assistant messages",
                                  param=f"{where}[{j}]")
            else:
                raise bad_request(f"{where}[{j}]: {block.type} content is not supported by this text-only model",
                                  param=f"{where}[{j}]")
        if texts or not any(b.type == "tool_result" for b in msg.content):
            out.append({"role": msg.role, "content": _parts(texts, where)})
    return out


def chat_tools(tools: list[ToolParam] | None) -> list[dict[str, Any]] | None:
    """Client tools as OpenAI function tools; server tools (a ``type`` and no schema) are left out."""
    converted = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema or {"type": "object"}}}
                 for t in tools or [] if t.input_schema is not None or t.type in (None, "custom")]
    return converted or None


def chat_tool_choice(choice: ToolChoiceParam | None, has_tools: bool) -> Any:
    if choice is None or not has_tools:
        return "none" if choice is not None and choice.type == "none" else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice.name is required when tool_choice.type is 'tool'", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The canonical request the turn core runs; a field the core refuses is a 400 naming it."""
    tools = chat_tools(req.tools)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": system_messages(req.system) + chat_messages(req.messages),
        "tools": tools,
        "tool_choice": chat_tool_choice(req.tool_choice, bool(tools)),
        "response_format": ({"type": "json_schema", "json_schema": {"name": "output",
                                                                      "schema": req.output_config.format.schema_}}
                            if req.output_config and req.output_config.format else None),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k if req.top_k else None,
        "stop": req.stop_sequences or None,
    }
    return canonical_request(body)


# ----------------------------------------------------------------------------- answer


def stop_reason(out: GenerateOutput, message: ResponseMessage) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for one finished output."""
    if message.tool_calls:
        return "tool_use", None
    if engine_reason(out) == "length":
        return "max_tokens", None
    stop = matched_stop(out)
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def content_blocks(message: ResponseMessage) -> list[ContentBlock]:
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls or []:
        blocks.append(ToolUseBlock(id=call.id, name=call.function.name, input=tool_input(call.function.arguments)))
    return blocks


def usage(result: TurnResult) -> MessagesUsage:
    return MessagesUsage(input_tokens=result.usage.prompt_tokens, output_tokens=result.usage.completion_tokens)


def message_response(turn: ChatTurn, result: TurnResult, model: str) -> MessageResponse:
    out, message = result.outs[0], result.messages[0]
    reason, stop = stop_reason(out, message)
    return MessageResponse(id=turn.response_id, model=model, content=content_blocks(message), stop_reason=reason,
                           stop_sequence=stop, usage=usage(result))


# ----------------------------------------------------------------------------- stream


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class BlockWriter:
    """Content blocks as Anthropic streams them: one open block at a time, indices in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = kind
        return [*events, sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, delta: DeltaMessage) -> list[str]:
        events: list[str] = []
        if delta.reasoning_content:
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.id is not None:
                events += self._start("tool_use", {"type": "tool_use", "id": call.id,
                                                   "name": call.function.name or "", "input": {}})
            if call.function.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return events


async def stream_events(turn: ChatTurn, call: dict[str, Any], model: str) -> AsyncIterator[str]:
    """``message_start``, the blocks as they grow, (record), ``message_delta``, ``message_stop``."""
    start = MessageResponse(id=turn.response_id, model=model, content=[],
                            usage=MessagesUsage(input_tokens=len(turn.prepared.prompt_ids), output_tokens=0))
    yield sse("message_start", {"type": "message_start", "message": start.model_dump()})
    blocks = BlockWriter()
    try:
        async for event in turn_events(turn.gw, turn, call):
            if isinstance(event, StreamDelta):
                for line in blocks.feed(event.delta):
                    yield line
                continue
            for line in blocks.feed(event.finals[0]) + blocks.close():
                yield line
            reason, stop = stop_reason(event.result.outs[0], event.result.messages[0])
            yield sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": stop},
                                        "usage": usage(event.result).model_dump()})
            yield sse("message_stop", {"type": "message_stop"})
    except APIError as e:
        yield sse("error", anthropic_error_body(e))
