"""Tool-call parsers: model text -> OpenAI ``tool_calls``, whole-text and streaming.

Why a registry keyed by model family: each family writes calls differently (Qwen/Hermes wrap a
JSON object in ``<tool_call>…</tool_call>``, Llama 3 emits bare JSON, optionally after
``<|python_tag|>``, Mistral a JSON list after ``[TOOL_CALLS]``), like SGLang's ``--tool-call-parser``. Arguments are returned as the exact JSON
substring the model produced, so a client that sends the call back gets the same tokens rendered
again (token-exact sessions, ARCHITECTURE decision 3).

Streaming: ``StreamingToolParser.feed(delta)`` returns content to show now plus tool-call deltas.
Text that might be the beginning of a call marker is held back until it is decided. A Hermes call
is announced (id + name) as soon as ``{"name": "…", "arguments": {`` is seen, and its arguments
stream as the model writes them, up to the end of the arguments object; at the closing marker the
whole-text parse confirms them (the streamed arguments are then exactly the recorded ones). A model
that breaks a call it began leaves that call with the arguments streamed so far, and the block's
text follows as content, as the whole-text parse has it. Llama 3 and Mistral calls are bare JSON
without a closing marker: they are emitted whole at the end.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from slime_server.gateway.protocol import DeltaFunctionCall, DeltaToolCall, new_id


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON string, exactly as produced by the model when possible
    id: str = field(default_factory=lambda: new_id("call"))


@dataclass
class ParseResult:
    content: str | None
    calls: list[ParsedCall]


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


# The head of a Hermes call whose arguments are a JSON object: name known, the arguments about to stream.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass
class _OpenCall:
    """A call announced before its closing marker; ``scan`` yields its arguments as they grow."""

    call: ParsedCall
    index: int
    args_start: int  # where the arguments object starts in the call's body
    sent: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    closed: bool = False  # the arguments object is complete: nothing more streams before the marker

    def scan(self, body: str) -> str:
        """New text of the arguments object in ``body`` (the text after ``<tool_call>`` so far)."""
        start = self.args_start + len(self.sent)
        end = start
        for ch in body[start:]:
            if self.closed:
                break
            end += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.closed = self.depth <= 0
        piece = body[start:end]
        self.sent += piece
        return piece


def _arguments_substring(obj_text: str, key: str, value: object) -> str:
    """The exact text of ``obj[key]`` inside ``obj_text`` (falls back to json.dumps)."""
    decoder = json.JSONDecoder()
    for m in re.finditer(rf'"{key}"\s*:\s*', obj_text):
        try:
            got, end = decoder.raw_decode(obj_text, m.end())
        except json.JSONDecodeError:
            continue
        if got == value:
            return obj_text[m.end():end]
    return json.dumps(value, ensure_ascii=False)


def _call_from_json(text: str, args_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall | None:
    """Parse one ``{"name": ..., "arguments": {...}}`` object; None if it is not a call."""
    text = text.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    if end != len(text) or not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None  # no call without a name (a tool call's name is never empty: it stays text)
    for key in args_keys:
        if key in obj:
            value = obj[key]
            if isinstance(value, str):  # some models emit arguments already JSON-encoded
                return ParsedCall(obj["name"], value)
            return ParsedCall(obj["name"], _arguments_substring(text, key, value))
    return ParsedCall(obj["name"], "{}")


class ToolCallParser(ABC):
    """Whole-text parsing for one model family."""

    @abstractmethod
    def parse(self, text: str) -> ParseResult: ...

    def streaming(self) -> StreamingToolParser:
        return StreamingToolParser(self)


class HermesToolParser(ToolCallParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen 2.5/3)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str) -> ParseResult:
        calls: list[ParsedCall] = []
        content_parts: list[str] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                content_parts.append(text[pos:])
                break
            j = text.find(self.end, i + len(self.start))
            call = _call_from_json(text[i + len(self.start):j]) if j >= 0 else None
            if call is None:  # unterminated or malformed: keep it visible as content
                content_parts.append(text[pos:])
                break
            content_parts.append(text[pos:i])
            calls.append(call)
            pos = j + len(self.end)
        content = "".join(content_parts)
        if calls:
            content = content.strip()
        return ParseResult(content or None, calls)


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.x JSON calls: ``[<|python_tag|>]{"name": ..., "parameters": {...}}`` separated by ``;``."""

    python_tag = "<|python_tag|>"

    def parse(self, text: str) -> ParseResult:
        body = text.strip()
        prefix = ""
        if self.python_tag in body:
            prefix, _, body = body.partition(self.python_tag)
            body = body.strip()
        if not body.startswith("{"):
            return ParseResult(text or None, [])
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                _, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParseResult(text or None, [])
            call = _call_from_json(body[pos:end], ("parameters", "arguments"))
            if call is None:
                return ParseResult(text or None, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParseResult(prefix.strip() or None, calls)


class MistralToolParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizer; also with ``"id"``),
    or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+)."""

    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    def parse(self, text: str) -> ParseResult:
        head, found, body = text.partition(self.marker)
        if not found:
            return ParseResult(text or None, [])
        calls = self._calls(body.strip()) if body.strip() else None
        if not calls:
            return ParseResult(text or None, [])
        return ParseResult(head.strip() or None, calls)

    def _calls(self, body: str) -> list[ParsedCall] | None:
        if body.startswith("["):
            try:
                items, end = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError:
                return None
            if end != len(body) or not isinstance(items, list) or not items:
                return None
            exact: list[ParsedCall] = []  # each call parsed from its own text: arguments exactly as produced
            pos = 1
            for _ in items:
                start, stop = _next_object(body, pos)
                call = _call_from_json(body[start:stop]) if start >= 0 else None
                if call is None:
                    return None
                exact.append(call)
                pos = stop
            return exact
        calls: list[ParsedCall] = []  # v11+: name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for part in body.split(self.marker):
            name, found, args = part.partition(self.args_marker)
            if not found or not name.strip():
                return None
            try:
                json.loads(args)
            except json.JSONDecodeError:
                return None
            calls.append(ParsedCall(name.strip(), args.strip()))
        return calls


def _next_object(text: str, pos: int) -> tuple[int, int]:
    """Span of the next top-level JSON object in ``text`` from ``pos`` ((-1, -1) if none)."""
    start = text.find("{", pos)
    if start < 0:
        return -1, -1
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return -1, -1
    return start, end


class StreamingToolParser:
    """Incremental parser: ``feed(delta)`` -> content to emit now + complete tool-call deltas."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.buffer = ""  # undecided text (a possible call or marker prefix)
        self.emitted_calls: list[ParsedCall] = []
        self._bare_json: bool | None = None  # llama3: decided by the first non-space character
        self._pending_ws = ""
        self._shown_content = False
        self._open: _OpenCall | None = None

    def feed(self, delta: str) -> StreamDelta:
        self.buffer += delta
        if isinstance(self.parser, HermesToolParser):
            return self._feed_hermes(self.parser)
        if isinstance(self.parser, MistralToolParser):
            return self._feed_until_marker(self.parser.marker)
        return self._feed_llama3()

    def finish(self) -> StreamDelta:
        """Flush at end of generation: parse what is left (e.g. a trailing bare-JSON call)."""
        rest, self.buffer = self.buffer, ""
        self._open = None  # a call cut before its closing marker: its text is content, as parse() has it
        out = StreamDelta()
        if rest:
            result = self.parser.parse(rest)
            for call in result.calls:
                out.tool_calls.extend(self._emit(call))
            out.content = self._content(result.content or "")
        if not self.emitted_calls:  # no call at all: whitespace is real content
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _content(self, text: str) -> str:
        """Hold back whitespace-only runs: dropped next to tool calls (as ``parse`` strips them)."""
        if not text:
            return ""
        if not text.strip():
            self._pending_ws += text
            return ""
        if self.emitted_calls and not self._pending_ws and not self._shown_content:
            text = text.lstrip()
        text, self._pending_ws = self._pending_ws + text, ""
        stripped = text.rstrip()
        self._pending_ws = text[len(stripped):]
        self._shown_content = True
        return stripped

    def _emit(self, call: ParsedCall) -> list[DeltaToolCall]:
        self._pending_ws = ""
        index = len(self.emitted_calls)
        self.emitted_calls.append(call)
        return [
            DeltaToolCall(index=index, id=call.id, type="function",
                          function=DeltaFunctionCall(name=call.name, arguments="")),
            DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments)),
        ]

    def _feed_hermes(self, p: HermesToolParser) -> StreamDelta:
        out = StreamDelta()
        while self.buffer:
            i = self.buffer.find(p.start)
            if i < 0:
                keep = _partial_suffix(self.buffer, p.start)
                emit, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                out.content += self._content(emit)
                break
            out.content += self._content(self.buffer[:i])
            self.buffer = self.buffer[i:]
            j = self.buffer.find(p.end)
            if j < 0:
                out.tool_calls.extend(self._stream_open_call(self.buffer[len(p.start):]))
                break  # the rest waits for the closing marker
            block = self.buffer[: j + len(p.end)]
            call = _call_from_json(block[len(p.start): j])
            opened, self._open = self._open, None
            if opened is not None:
                rest = self._finish_open_call(opened, call)
                if rest is None:
                    out.content += self._content(block)
                else:
                    out.tool_calls.extend(rest)
            elif call is None:
                out.content += self._content(block)
            else:
                out.tool_calls.extend(self._emit(call))
            self.buffer = self.buffer[j + len(p.end):]
        return out

    def _stream_open_call(self, body: str) -> list[DeltaToolCall]:
        """Announce a call once its name and the start of its arguments are written; stream those."""
        deltas: list[DeltaToolCall] = []
        if self._open is None:
            head = _CALL_HEAD.match(body)
            if head is None:
                return []
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return []
            if not name:  # as the whole-text parser: a call without a name is no call
                return []
            call = ParsedCall(name, "")
            self._pending_ws = ""
            self._open = _OpenCall(call=call, index=len(self.emitted_calls), args_start=head.end())
            self.emitted_calls.append(call)
            deltas.append(DeltaToolCall(index=self._open.index, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=name, arguments="")))
        piece = self._open.scan(body)
        if piece:
            deltas.append(DeltaToolCall(index=self._open.index, function=DeltaFunctionCall(arguments=piece)))
        return deltas

    @staticmethod
    def _finish_open_call(opened: _OpenCall, call: ParsedCall | None) -> list[DeltaToolCall] | None:
        """The rest of an announced call's arguments, or None when the whole-text parse disowns the call."""
        if call is None or call.name != opened.call.name or not call.arguments.startswith(opened.sent):
            return None
        opened.call.arguments = call.arguments
        rest = call.arguments[len(opened.sent):]
        return [DeltaToolCall(index=opened.index, function=DeltaFunctionCall(arguments=rest))] if rest else []

    def _feed_until_marker(self, marker: str) -> StreamDelta:
        """Content up to ``marker``; from the marker on, everything is calls, decided at finish()."""
        if self._bare_json:
            return StreamDelta()
        i = self.buffer.find(marker)
        if i >= 0:
            self._bare_json = True
            emit, self.buffer = self.buffer[:i], self.buffer[i:]
            return StreamDelta(content=self._content(emit))
        keep = _partial_suffix(self.buffer, marker)
        emit, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return StreamDelta(content=self._content(emit))

    def _feed_llama3(self) -> StreamDelta:
        if self._bare_json is None:
            stripped = self.buffer.lstrip()
            if not stripped:
                return StreamDelta()
            tag = Llama3JsonToolParser.python_tag
            if stripped.startswith("{") or stripped.startswith(tag):
                self._bare_json = True
            elif tag.startswith(stripped):
                return StreamDelta()  # could still become the python tag
            else:
                self._bare_json = False
        if self._bare_json:
            return StreamDelta()  # a JSON call: decided at finish()
        text, self.buffer = self.buffer, ""
        return StreamDelta(content=text)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "qwen25": HermesToolParser,
    "qwen3": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama3": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser for the format a chat template teaches its model (``auto``, as SGLang's per-family choice).

    Llama 3.x templates describe calls as bare JSON (``<|python_tag|>``/``ipython`` turns), Mistral's as
    ``[TOOL_CALLS]``; Qwen, Hermes and every template without tool support (our system-prompt fallback)
    use ``<tool_call>``.
    """
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def get_tool_parser(name: str, chat_template: str | None = None) -> ToolCallParser:
    """Parser for a model family name (see ``TOOL_PARSERS``; ``auto`` reads the chat template); KeyError
    names the known ones."""
    if name == "auto":
        name = detect_tool_parser(chat_template)
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool parser {name!r}; known: auto, {', '.join(sorted(TOOL_PARSERS))}") from None
