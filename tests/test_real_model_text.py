"""Non-ASCII text through the whole stack on a real pretrained model (SmolLM2-135M-Instruct).

Served by the CPU engine behind the real sgl-router, asked through the real ``openai`` SDK: answers in
Chinese, Japanese, French and emoji (one of which is cut by ``max_tokens`` inside a character) stream
exactly as they answer unstreamed, show no U+FFFD the model did not produce, and their logprob
``bytes`` are the UTF-8 of their text; the same for tool calls whose arguments are not ASCII. SmolLM2's
chat template ignores ``tools``: the gateway describes them in the system prompt (its documented
fallback), or refuses them with a 400 when that is switched off.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from slime_server.gateway.token_text import incomplete_utf8_tail
from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    engine_and_router,
    openai_client,
    running_gateway,
    start_gateway,
    stop_gateway,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytestmark = pytest.mark.slow

PROMPTS = [  # greedy SmolLM2 answers these in the script named
    "Repeat exactly: 北京是中国的首都。",  # Chinese
    "Say hello in Japanese.",  # Japanese
    "Write one sentence in French about the café.",  # accented Latin
    "Reply with three emoji.",  # emoji: 4-byte characters, 3 tokens each; cut by max_tokens inside one
]
MAX_TOKENS = 32
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def router_url(real_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engine_and_router(real_model_path, tmp_path_factory.mktemp("stack")) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(router_url: str, real_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    d = tmp_path_factory.mktemp("gateway")
    with running_gateway(router_url, real_model_path, d / "traj.db", d / "gateway.log") as gw:
        yield gw


def _ask(gw: GatewayProc, stream: bool, **kw) -> tuple[str, list[int], str, list[dict]]:
    """(content, concatenated logprob bytes, finish reason, tool calls as dicts) of choice 0."""
    client = openai_client(gw)
    kw = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True, "seed": 3, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        data = [b for e in c.logprobs.content for b in e.bytes]
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
        return c.message.content or "", data, c.finish_reason, calls
    content, data, reason, calls = "", [], None, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        data += [b for e in (c.logprobs.content if c.logprobs else None) or [] for b in e.bytes]
        for t in c.delta.tool_calls or []:
            entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
            entry["name"] += (t.function.name or "") if t.function else ""
            entry["arguments"] += (t.function.arguments or "") if t.function else ""
        reason = c.finish_reason or reason
    return content, data, reason, [calls[i] for i in sorted(calls)]


def _answer_bytes(data: list[int], reason: str) -> bytes:
    """The bytes the answer's text stands for: less the stop token (<|im_end|>) of a finished answer."""
    raw = bytes(data)
    if reason == "stop":
        assert raw.endswith(b"<|im_end|>")
        raw = raw[: -len(b"<|im_end|>")]
    return raw


def test_non_ascii_answers_stream_as_they_answer(gateway: GatewayProc) -> None:
    cut_inside_a_character = 0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        plain = _ask(gateway, False, messages=messages)
        streamed = _ask(gateway, True, messages=messages)
        content, data, reason, _ = plain
        assert streamed[:3] == plain[:3], prompt  # text, token bytes, finish reason
        assert any(ord(ch) > 127 for ch in content), (prompt, content)
        raw = _answer_bytes(data, reason)
        open_tail = incomplete_utf8_tail(raw)
        cut_inside_a_character += bool(open_tail)
        assert open_tail == 0 or reason == "length"
        assert content.encode() == raw[: len(raw) - open_tail], prompt  # the text is the tokens' bytes
        assert "\ufffd" not in content, (prompt, content)
    assert cut_inside_a_character  # the max_tokens cut of a partial character was exercised


def test_tool_calls_with_non_ascii_arguments(gateway: GatewayProc) -> None:
    for prompt, word in (("天气怎么样，北京？", "北京"), ("Wie ist das Wetter in München?", "München")):
        kw = dict(messages=[{"role": "user", "content": prompt}], tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=48)
        plain = _ask(gateway, False, **kw)
        streamed = _ask(gateway, True, **kw)
        assert plain[2] == streamed[2] == "tool_calls"
        assert plain[3] == streamed[3]
        (call,) = plain[3]
        assert call["name"] == "get_weather"
        assert word in json.dumps(json.loads(call["arguments"]), ensure_ascii=False)


def test_tools_are_refused_when_the_template_ignores_them_and_the_fallback_is_off(
        router_url: str, real_model_path: Path, tmp_path: Path) -> None:
    gw = start_gateway(router_url, real_model_path, tmp_path / "traj.db", tmp_path / "gateway.log",
                       settings={"tools_fallback": "error"})
    try:
        client = openai_client(gw)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=[WEATHER], max_tokens=4)
        err = info.value.body
        assert (err["code"], err["param"]) == ("tools_not_supported", "tools")
        assert "ignores tools" in err["message"]
        ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert ok.choices[0].finish_reason in ("length", "stop")
    finally:
        stop_gateway(gw)


def test_a_conversation_with_cut_characters_stays_one_trajectory(gateway: GatewayProc) -> None:
    """Answers cut by max_tokens inside a character (their text drops it, their tokens keep it) are sent
    back as the client got them: the session still merges token-exactly, with SmolLM2's own template."""
    import httpx

    sid = httpx.post(f"{gateway.base_url}/sessions", json={}, timeout=30).json()["id"]
    client = openai_client(gateway)
    messages: list[dict] = []
    for prompt in (PROMPTS[3], PROMPTS[1], PROMPTS[0]):  # the emoji answer is cut inside a character
        messages.append({"role": "user", "content": prompt})
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                           extra_headers={"X-Session-Id": sid})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    info = httpx.get(f"{gateway.base_url}/sessions/{sid}", timeout=30).json()
    assert info["num_turns"] == 3 and info["segment_splits"] == 0
    (traj,) = httpx.get(f"{gateway.base_url}/sessions/{sid}/trajectory", timeout=30).json()
    assert len(traj["turns"]) == 3
