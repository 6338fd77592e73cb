"""``<think>`` splitting: whole-text rules, and streaming == whole-text for every chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_server.gateway.reasoning import ReasoningParser, get_reasoning_parser


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>\nplan it\n</think>\n\nThe answer.", "plan it", "The answer."),
    ("The answer.", None, "The answer."),
    ("The answer mentions </think> late.", None, "The answer mentions </think> late."),
    ("<think>unfinished thought", "unfinished thought", ""),
    ("  <think></think>Direct.", None, "Direct."),
])
def test_parse(text: str, reasoning: str | None, content: str) -> None:
    r = ReasoningParser().parse(text)
    assert (r.reasoning, r.content) == (reasoning, content)


def test_forced_block_when_template_opened_it() -> None:
    r = get_reasoning_parser("deepseek-r1").parse("thinking...</think>done")
    assert (r.reasoning, r.content) == ("thinking...", "done")
    with pytest.raises(KeyError):
        get_reasoning_parser("unknown")


TEXTS = ["<think>\nplan  it \n</think>\n\nThe answer.", "The answer.", "<think>unfinished  ", "<thi", "  <think>",
         "<think>a</think>", "x </think> y", "<think>\n\n</think>\n\ncontent\n"]


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(text[prev:p])
        prev = p
    return out + [text[prev:]]


@settings(max_examples=80, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 60), max_size=10),
       force=st.booleans())
def test_streaming_equals_whole_text(text: str, cuts: list[int], force: bool) -> None:
    p = ReasoningParser(force=force)
    whole = p.parse(text)
    s = p.streaming()
    reasoning, content = "", ""
    for piece in _chunks(text, cuts):
        r, c = s.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    reasoning, content = reasoning + r, content + c
    assert (reasoning or None, content) == (whole.reasoning, whole.content)
