"""Tool-call parsers: whole-text results, and streaming == whole-text for every way of chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_server.gateway.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCallParser,
    get_tool_parser,
)

ARGS = '{"city":  "Paris", "days": [1, 2],"unit": "°C"}'  # odd spacing and non-ASCII on purpose
ONE = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def test_hermes_one_call_keeps_exact_argument_text() -> None:
    r = HermesToolParser().parse(ONE)
    assert r.content is None
    assert [(c.name, c.arguments) for c in r.calls] == [("get_weather", ARGS)]
    assert json.loads(r.calls[0].arguments) == {"city": "Paris", "days": [1, 2], "unit": "°C"}
    assert r.calls[0].id.startswith("call_")


def test_hermes_two_calls_with_leading_content() -> None:
    r = HermesToolParser().parse("Let me check.\n" + TWO)
    assert r.content == "Let me check."
    assert [c.name for c in r.calls] == ["get_weather", "now"]
    assert r.calls[1].arguments == "{}"
    assert len({c.id for c in r.calls}) == 2


@pytest.mark.parametrize("text", [
    "no calls here",
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "x", "arguments": {}}',  # unterminated
    '<tool_call>\n["not", "an", "object"]\n</tool_call>',
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',  # no name: no call (seen from a random tiny model)
])
def test_hermes_non_calls_stay_content(text: str) -> None:
    r = HermesToolParser().parse(text)
    assert r.calls == []
    assert r.content == text


def test_llama3_python_tag_and_bare_json() -> None:
    p = Llama3JsonToolParser()
    r = p.parse('<|python_tag|>{"name": "search", "parameters": {"q": "x"}}')
    assert [(c.name, c.arguments) for c in r.calls] == [("search", '{"q": "x"}')]
    r = p.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}')
    assert [(c.name, c.arguments) for c in r.calls] == [("a", "{}"), ("b", '{"k": 1}')]
    assert p.parse("Hello {there}").calls == []
    assert p.parse("Hello {there}").content == "Hello {there}"


def test_registry() -> None:
    assert isinstance(get_tool_parser("qwen"), HermesToolParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonToolParser)
    with pytest.raises(KeyError, match="known"):
        get_tool_parser("nope")


def _stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Consume the stream the way the OpenAI SDK accumulates deltas (by tool-call index)."""
    s = parser.streaming()
    content = ""
    calls: dict[int, list[str]] = {}
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            entry = calls.setdefault(tc.index, ["", ""])
            if tc.id is not None:
                assert tc.id.startswith("call_") and tc.type == "function"
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
    return content, [(n, a) for _, (n, a) in sorted(calls.items())]


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(text[prev:p])
        prev = p
    return out + [text[prev:]]


TEXTS = [ONE, TWO, "Let me check.\n" + TWO, "plain answer with <tool_ and <tool_call without end",
         '<tool_call>\n{"name": "s", "arguments": {"q": "}{\\\\\\"", "k": [{}]}}\n</tool_call>',
         "a < b and <tool_call>\n{bad}\n</tool_call> tail", "  \n" + ONE + "\n  ",
         '<tool_call>\n{"name": "", "arguments": {"a": 1}}\n</tool_call>']


def test_hermes_arguments_stream_as_they_are_written() -> None:
    """The call is announced at its name; its arguments leave piece by piece, before the closing marker."""
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "n": [1, {"x": 2}]}}\n</tool_call>'
    s = HermesToolParser().streaming()
    seen: list[tuple[int, str | None, str]] = []  # (characters fed, name, arguments piece)
    for k in range(1, len(text) + 1):
        for tc in s.feed(text[k - 1]).tool_calls:
            seen.append((k, tc.function.name, tc.function.arguments or ""))
    for tc in s.finish().tool_calls:
        seen.append((len(text) + 1, tc.function.name, tc.function.arguments or ""))
    (whole,) = HermesToolParser().parse(text).calls
    assert "".join(a for _, _, a in seen) == whole.arguments == '{"city": "Pa\\"ris", "n": [1, {"x": 2}]}'
    announced = next(k for k, name, _ in seen if name)
    assert text[:announced].endswith('"arguments": {')  # the name is out as the arguments begin
    closing = text.index("</tool_call>")
    assert max(k for k, _, a in seen if a) <= text.index("}}") + 1 < closing  # all arguments out before the marker
    assert len([a for _, _, a in seen if a]) > 10  # and piece by piece, not in one delta


def test_a_broken_call_after_its_announcement_ends_as_content() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}, oops}\n</tool_call> after'
    content, calls = _stream(HermesToolParser(), list(text))
    assert calls == [("f", '{"a": 1}')]  # announced and streamed, never confirmed
    assert content == text  # the block is content, as the whole-text parse has it
    assert HermesToolParser().parse(text).content == text


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_hermes_streaming_equals_whole_text(text: str, cuts: list[int]) -> None:
    p = HermesToolParser()
    whole = p.parse(text)
    content, calls = _stream(p, _chunks(text, cuts))
    assert calls == [(c.name, c.arguments) for c in whole.calls]
    assert (content or None) == whole.content


LLAMA = ['<|python_tag|>{"name": "search", "parameters": {"q": "x"}}', '{"name": "a", "parameters": {}}',
         "just text", " <|python"]


@settings(max_examples=40, deadline=None)
@given(text=st.sampled_from(LLAMA), cuts=st.lists(st.integers(0, 80), max_size=8))
def test_llama3_streaming_equals_whole_text(text: str, cuts: list[int]) -> None:
    p = Llama3JsonToolParser()
    whole = p.parse(text)
    content, calls = _stream(p, _chunks(text, cuts))
    assert calls == [(c.name, c.arguments) for c in whole.calls]
    assert (content or None) == whole.content


def test_auto_reads_the_call_format_from_the_chat_template() -> None:
    from slime_server.gateway.tool_parsers import Llama3JsonToolParser, detect_tool_parser, get_tool_parser

    assert detect_tool_parser("{{ '<tool_call>' }}{{ tools | tojson }}") == "hermes"  # Qwen, Hermes
    assert detect_tool_parser("{%- if builtin_tools %}<|python_tag|>{% endif %}ipython") == "llama3_json"  # Llama 3
    assert detect_tool_parser("{{- '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert detect_tool_parser(None) == "hermes"  # no tool support: the system-prompt fallback's format
    assert isinstance(get_tool_parser("auto", "<|python_tag|>"), Llama3JsonToolParser)
    with pytest.raises(KeyError, match="auto"):
        get_tool_parser("nope")


MISTRAL_LIST = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}, {{"name": "now", "arguments": {{}}}}]'
MISTRAL = ["Let me look. " + MISTRAL_LIST, MISTRAL_LIST,
           f"[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]now[ARGS]{{}}",  # v11+ format
           "no call here [TOOL_CA", "[TOOL_CALLS] not json"]


def test_mistral_calls_keep_exact_arguments() -> None:
    from slime_server.gateway.tool_parsers import MistralToolParser

    p = MistralToolParser()
    for text, content in ((MISTRAL[0], "Let me look."), (MISTRAL[1], None), (MISTRAL[2], None)):
        got = p.parse(text)
        assert [(c.name, c.arguments) for c in got.calls] == [("get_weather", ARGS), ("now", "{}")]
        assert got.content == content
    for text in MISTRAL[3:]:  # not a call: stays content, nothing dropped
        got = p.parse(text)
        assert got.calls == [] and got.content == text


@settings(max_examples=40, deadline=None)
@given(text=st.sampled_from(MISTRAL), cuts=st.lists(st.integers(0, 120), max_size=8))
def test_mistral_streaming_equals_whole_text(text: str, cuts: list[int]) -> None:
    from slime_server.gateway.tool_parsers import MistralToolParser

    p = MistralToolParser()
    whole = p.parse(text)
    content, calls = _stream(p, _chunks(text, cuts))
    assert calls == [(c.name, c.arguments) for c in whole.calls]
    assert (content or None) == whole.content
