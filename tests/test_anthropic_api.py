"""Acceptance (issue 21): the real ``anthropic`` SDK against ``/v1/messages`` on the gateway process, in
front of the real sgl-router and a CPU engine serving the tiny model fine-tuned to call a tool.

Every turn is checked in the store: one trajectory per conversation, loss mask exactly on the
generated tokens, the second turn's prompt the first turn's tokens plus the tool result.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from tests._gateway_helpers import (
    MODEL,
    TOOL_RESULT,
    TOOL_USER,
    WEATHER_TOOL,
    GatewayProc,
    check_mask,
    check_one_turn,
    new_session,
    session_trajectories,
    start_gateway,
    stop_gateway,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOOL = {"name": WEATHER_TOOL["function"]["name"], "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}


def client(gw: GatewayProc, api_key: str = "EMPTY") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=api_key, max_retries=0, timeout=120)


def test_create_and_stream_give_the_same_message_and_record(tool_gateway: GatewayProc) -> None:
    c = client(tool_gateway)
    kw = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0.0}, system="Be brief.",
              messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}])
    sid_a, sid_b = new_session(tool_gateway), new_session(tool_gateway)
    plain = c.messages.create(**kw, extra_headers={"X-Session-Id": sid_a})
    with c.messages.stream(**kw, extra_headers={"X-Session-Id": sid_b}) as s:
        deltas = [e.delta.text for e in s if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        final = s.get_final_message()
    assert plain.id.startswith("msg_") and plain.type == "message" and plain.role == "assistant"
    assert plain.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in plain.content if b.type == "text")
    assert text and "".join(deltas) == text
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.usage.output_tokens == plain.usage.output_tokens
    for sid, msg in ((sid_a, plain), (sid_b, final)):
        check_one_turn(tool_gateway, sid, msg.usage.input_tokens, msg.usage.output_tokens)


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_tool_use_and_tool_result_round_trip_is_one_trajectory(tool_gateway: GatewayProc, streamed: bool) -> None:
    c = client(tool_gateway)
    sid = new_session(tool_gateway)
    hdr = {"X-Session-Id": sid}
    messages: list[dict] = [{"role": "user", "content": TOOL_USER}]
    kw = dict(model=MODEL, max_tokens=40, extra_body={"temperature": 0.0}, tools=[TOOL], extra_headers=hdr)
    if streamed:
        with c.messages.stream(messages=messages, **kw) as s:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
            first = s.get_final_message()
        assert kinds.count(("content_block_delta", "input_json_delta")) > 1  # the arguments stream as generated
        assert kinds.index(("message_delta", None)) > max(i for i, k in enumerate(kinds) if k[0] == "content_block_stop")
    else:
        first = c.messages.create(messages=messages, **kw)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]}]
    second = c.messages.create(messages=messages, **{**kw, "max_tokens": 16})
    (traj,) = session_trajectories(tool_gateway, sid)
    check_mask(traj, 2)
    t0, t1 = traj["turns"]
    assert t0["output_end"] - t0["output_start"] == first.usage.output_tokens
    assert t1["prompt_start"] == t0["output_end"]  # the model's own tokens, then the tool result: nothing re-rendered
    assert t1["output_start"] == second.usage.input_tokens


def test_stop_sequence_is_reported(tool_gateway: GatewayProc) -> None:
    c = client(tool_gateway)
    kw = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0.0}, messages=[{"role": "user", "content": "Tell me a story."}])
    text = c.messages.create(**kw).content[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop.strip()
    cut = c.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    with c.messages.stream(**kw, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == cut.content[0].text


def test_count_tokens_is_the_prompt_a_message_bills(tool_gateway: GatewayProc) -> None:
    c = client(tool_gateway)
    kw = dict(model=MODEL, system="Be brief.", tools=[TOOL], messages=[{"role": "user", "content": TOOL_USER}])
    counted = c.messages.count_tokens(**kw)
    made = c.messages.create(**kw, max_tokens=1)
    assert counted.input_tokens == made.usage.input_tokens > 20


def test_errors_are_in_anthropic_format(tool_gateway: GatewayProc) -> None:
    c = client(tool_gateway)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nonexistent", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "image" in e.value.body["error"]["message"]
    r = httpx.post(f"{tool_gateway.base_url}/messages", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(f"{tool_gateway.base_url}/chat/completions", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()


def test_x_api_key_authenticates(tool_router_url: str, tool_model: Path, tmp_path: Path) -> None:
    gw = start_gateway(tool_router_url, tool_model, tmp_path / "keyed.db", tmp_path / "keyed.log",
                       settings={"api_key": "sekret"})
    try:
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(gw, api_key="wrong").messages.create(model=MODEL, max_tokens=2,
                                                        messages=[{"role": "user", "content": "Hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        ok = client(gw, api_key="sekret").messages.create(model=MODEL, max_tokens=2,
                                                          messages=[{"role": "user", "content": "Hi"}])
        assert ok.usage.output_tokens >= 1
    finally:
        stop_gateway(gw)


def test_claude_code_session_header_names_the_session(tool_gateway: GatewayProc) -> None:
    c = client(tool_gateway)
    sid = f"cc-{json.dumps(1)}-{id(c)}"
    msgs: list[dict] = [{"role": "user", "content": "Hi"}]
    first = c.messages.create(model=MODEL, max_tokens=6, extra_body={"temperature": 0.0}, messages=msgs,
                              extra_headers={"X-Claude-Code-Session-Id": sid})
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "text", "text": "More?"}]}]
    c.messages.create(model=MODEL, max_tokens=6, extra_body={"temperature": 0.0}, messages=msgs,
                      extra_headers={"X-Claude-Code-Session-Id": sid})
    (traj,) = session_trajectories(tool_gateway, sid)
    check_mask(traj, 2)


def test_one_session_may_switch_apis(tool_gateway: GatewayProc) -> None:
    """Chat Completions, then Anthropic Messages, then Responses, in one session: one trajectory, each turn
    extending the last with the model's own tokens (the three APIs share one turn core)."""
    import openai

    sid = new_session(tool_gateway)
    hdr = {"X-Session-Id": sid}
    oa = openai.OpenAI(base_url=tool_gateway.base_url, api_key="EMPTY", max_retries=0, timeout=120)
    history: list[dict] = [{"role": "user", "content": "Hi"}]
    first = oa.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0, extra_headers=hdr)
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "More?"}]
    second = client(tool_gateway).messages.create(model=MODEL, max_tokens=6, messages=history, extra_headers=hdr,
                                             extra_body={"temperature": 0.0})
    text = "".join(b.text for b in second.content if b.type == "text")
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    oa.responses.create(model=MODEL, input=history, max_output_tokens=6, temperature=0, store=False,
                        extra_headers=hdr)
    (traj,) = session_trajectories(tool_gateway, sid)
    check_mask(traj, 3)
    ends = [t["output_end"] for t in traj["turns"]]
    assert [t["prompt_start"] for t in traj["turns"][1:]] == ends[:-1]
    assert {t["response_id"][:4] for t in traj["turns"]} == {"chat", "msg_", "resp"}
