"""Acceptance (issue 21): the real ``openai`` SDK's ``responses`` API against the gateway process, in front
of the real sgl-router and a CPU engine serving the tiny model fine-tuned to call a tool.

Every turn is checked in the store: one trajectory per conversation, loss mask exactly on the
generated tokens, a continued turn's prompt the previous turn's tokens plus only the new input.
"""

from __future__ import annotations

import json

import httpx
import openai
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
    openai_client,
    session_trajectories,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOOL = {"type": "function", **WEATHER_TOOL["function"]}


def session_of(gw: GatewayProc, response_id: str) -> str:
    """The session a response was recorded in (the feedback route answers with it)."""
    r = httpx.post(f"{gw.base_url}/responses/{response_id}/feedback", json={"score": 0.0}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def test_create_and_stream_agree_and_are_recorded(tool_gateway: GatewayProc) -> None:
    c = openai_client(tool_gateway)
    kw = dict(model=MODEL, instructions="Be brief.", input="Tell me a story.", temperature=0, max_output_tokens=24)
    sid_a, sid_b = new_session(tool_gateway), new_session(tool_gateway)
    plain = c.responses.create(**kw, extra_headers={"X-Session-Id": sid_a})
    events = list(c.responses.create(**kw, stream=True, extra_headers={"X-Session-Id": sid_b}))
    assert plain.id.startswith("resp_") and plain.object == "response" and plain.output_text
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.status == plain.status
    assert final.usage.model_dump() == plain.usage.model_dump()
    with c.responses.stream(**kw, extra_headers={"X-Session-Id": new_session(tool_gateway)}) as s:
        helper = s.get_final_response() if plain.status == "completed" else None
    if helper is not None:
        assert helper.output_text == plain.output_text
    for sid, resp in ((sid_a, plain), (sid_b, final)):
        check_one_turn(tool_gateway, sid, resp.usage.input_tokens, resp.usage.output_tokens)


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_function_call_round_trip_through_previous_response_id(tool_gateway: GatewayProc, streamed: bool) -> None:
    c = openai_client(tool_gateway)
    kw = dict(model=MODEL, tools=[TOOL], temperature=0)
    if streamed:
        events = list(c.responses.create(input=TOOL_USER, max_output_tokens=40, stream=True, **kw))
        kinds = [e.type for e in events]
        assert kinds.count("response.function_call_arguments.delta") > 1  # the arguments stream as generated
        assert "response.function_call_arguments.done" in kinds
        assert kinds[-1] == "response.completed"
        first = events[-1].response
        added = [e.item.id for e in events if e.type == "response.output_item.added"]
        assert added == [item.id for item in first.output]
    else:
        first = c.responses.create(input=TOOL_USER, max_output_tokens=40, **kw)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = c.responses.create(previous_response_id=first.id, max_output_tokens=16, **kw,
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": TOOL_RESULT}])
    assert second.previous_response_id == first.id
    sid = session_of(tool_gateway, second.id)
    assert session_of(tool_gateway, first.id) == sid
    (traj,) = session_trajectories(tool_gateway, sid)
    check_mask(traj, 2)
    t0, t1 = traj["turns"]
    assert t0["output_end"] - t0["output_start"] == first.usage.output_tokens
    assert t1["prompt_start"] == t0["output_end"]  # the model's own tokens, then only the tool output
    assert t1["output_start"] == second.usage.input_tokens


def test_three_turn_chain_is_one_trajectory_and_retrievable(tool_gateway: GatewayProc) -> None:
    c = openai_client(tool_gateway)
    previous = None
    ids = []
    for k in range(3):
        r = c.responses.create(model=MODEL, instructions="Be brief.", input=f"Question {k}?", temperature=0,
                               max_output_tokens=6, previous_response_id=previous)
        ids.append(r.id)
        previous = r.id
    sid = session_of(tool_gateway, ids[-1])
    (traj,) = session_trajectories(tool_gateway, sid)
    check_mask(traj, 3)
    assert [t["prompt_start"] for t in traj["turns"][1:]] == [t["output_end"] for t in traj["turns"][:-1]]
    got = c.responses.retrieve(ids[1])
    assert got.id == ids[1] and got.previous_response_id == ids[0]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_doesnotexist")


def test_stateless_full_input_with_a_session_header_merges(tool_gateway: GatewayProc) -> None:
    """What Codex CLI does: store false, the whole conversation each time, its session id in a header."""
    c = openai_client(tool_gateway)
    sid = "codex-like-session"
    hdr = {"session_id": sid}
    items: list[dict] = [{"role": "developer", "content": "You are a weather agent."},
                         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TOOL_USER}]}]
    first = c.responses.create(model=MODEL, input=items, tools=[TOOL], temperature=0, max_output_tokens=40,
                               store=False, extra_headers=hdr)
    items += [item.model_dump(exclude_none=True) for item in first.output]
    (call,) = [item for item in first.output if item.type == "function_call"]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT})
    c.responses.create(model=MODEL, input=items, tools=[TOOL], temperature=0, max_output_tokens=8, store=False,
                       extra_headers=hdr)
    (traj,) = session_trajectories(tool_gateway, sid)
    check_mask(traj, 2)
    assert traj["turns"][1]["prompt_start"] == traj["turns"][0]["output_end"]
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing to retrieve or continue
        c.responses.retrieve(first.id)


def test_cut_by_max_output_tokens_is_incomplete(tool_gateway: GatewayProc) -> None:
    r = openai_client(tool_gateway).responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=2,
                                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_bad_input_is_an_openai_error(tool_gateway: GatewayProc) -> None:
    c = openai_client(tool_gateway)
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input=[image])
    assert "input_image" in e.value.body["message"] and e.value.body["param"] == "input[0].content[0]"
    with pytest.raises(openai.BadRequestError) as e:  # a json_schema format names its schema (issue 42)
        c.responses.create(model=MODEL, input="Hi", text={"format": {"type": "json_schema", "name": "x"}})
    assert "schema" in e.value.body["message"] and e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="gpt-nonexistent", input="Hi")
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL, input="Hi", previous_response_id="resp_missing")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input=[])
