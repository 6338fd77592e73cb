"""Structured outputs and forced tool calls through /v1 (issue 42), on the tiny model and on SmolLM2, each behind
the real sgl-router, asked through the real SDKs: Chat's ``response_format`` (json_schema, json_object, the
openai SDK's ``parse`` with a pydantic model), Responses' ``text.format``, Messages' ``output_config.format``;
a forced tool choice in each API (Chat and Responses ``required`` / named, Messages ``any`` / ``tool``),
streamed and not, always comes back as a parsed tool call whose arguments validate against the tool's schema;
what cannot be honoured is a 400 in each API's shape."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests._gateway_helpers import MODEL, GatewayProc, engine_and_router, openai_client, running_gateway

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# bounded everywhere (enums, integer ranges, maxLength, maxItems): a model that knows no JSON still finishes it.
# Whitespace too: the engines run with SGLang's --constrained-json-max-whitespace-cnt (any_whitespace otherwise lets
# a sampled answer wander through newlines until max_tokens). With at most MAX_WS whitespace characters in each of
# TRIP's ~32 gaps between JSON tokens, its longest answer is under 300 bytes (the note's 12 characters as
# \uXXXX\uXXXX escapes 146, the rest ~77, the gaps 64), so 300 tokens of at least a byte each always reach the end.
# The tiny model is asked without the length-bounded string (TINY_TRIP): it emits bytes no trained model would, and
# xgrammar's UTF-8 is loose (it takes overlong forms such as E0 80 80, which decode to three U+FFFD), so the
# characters it counted are not the ones Python counts; the JSON still parses.
TRIP = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "note": {"type": "string", "maxLength": 12},
        "plan": {"type": "object", "properties": {"mode": {"enum": ["bus", "train"]},
                                                  "stops": {"type": "array", "maxItems": 3,
                                                            "items": {"type": "integer", "minimum": 0,
                                                                      "maximum": 99}}},
                 "required": ["mode", "stops"], "additionalProperties": False},
    },
    "required": ["city", "days", "note", "plan"],
    "additionalProperties": False,
}
MAX_WS = 2
TINY_TRIP = {**TRIP, "properties": {k: v for k, v in TRIP["properties"].items() if k != "note"},
             "required": ["city", "days", "plan"]}
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima", "Paris"]},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                       "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                      "required": ["a", "b"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, ADD)}
CHAT_TOOLS = [{"type": "function", "function": t} for t in (WEATHER, ADD)]
ASK = [{"role": "user", "content": "Plan a short trip and answer in JSON."}]


class Trip(BaseModel):
    city: Literal["Paris", "Lima", "Oslo"]
    days: int = Field(ge=1, le=14)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    path: Path = request.getfixturevalue("tiny_model_path" if request.param == "tiny" else "real_model_path")
    d = tmp_path_factory.mktemp(f"structured-{request.param}")
    flags = {"constrained_json_max_whitespace_cnt": MAX_WS}
    with engine_and_router(path, d, flags) as router, running_gateway(router, path, d / "traj.db", d / "gw.log") as gw:
        gw.trip = TINY_TRIP if request.param == "tiny" else TRIP  # type: ignore[attr-defined]
        yield gw


def _valid(doc: object, schema: dict) -> None:
    jsonschema.Draft202012Validator(schema).validate(doc)


def test_json_schema_answers_validate_100_of_100(gateway: GatewayProc) -> None:
    c = openai_client(gateway)
    trip = gateway.trip
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": trip, "strict": True}}

    def ask(seed: int) -> list[str]:
        r = c.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, max_tokens=300, n=5, seed=seed,
                                      response_format=fmt)
        assert all(ch.finish_reason == "stop" for ch in r.choices), [ch.message.content for ch in r.choices]
        return [ch.message.content for ch in r.choices]

    with ThreadPoolExecutor(8) as pool:  # 40 samples in flight: the engine batches them
        answers = [a for batch in pool.map(ask, range(20)) for a in batch]
    assert len(answers) == 100
    for a in answers:
        _valid(json.loads(a), trip)
    assert len(set(answers)) > 20  # sampled at temperature 1, not one forced answer


def test_json_object_and_the_sdks_parse_helper(gateway: GatewayProc) -> None:
    c = openai_client(gateway)
    r = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=160,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # an unbounded object: a model that never closes a string runs out
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    parsed = c.chat.completions.parse(model=MODEL, messages=ASK, response_format=Trip, max_tokens=300,
                                      temperature=1.0, seed=3)
    assert isinstance(parsed.choices[0].message.parsed, Trip)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_forced_tool_calls_in_chat(gateway: GatewayProc, stream: bool, choice: str) -> None:
    c = openai_client(gateway)
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for seed in range(2):
        kw = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "tools": CHAT_TOOLS,
              "tool_choice": tool_choice, "temperature": 1.0, "max_tokens": 200, "seed": seed}
        if stream:
            calls: dict[int, dict[str, str]] = {}
            finish = None
            for chunk in c.chat.completions.create(stream=True, **kw):
                for ch in chunk.choices:
                    finish = ch.finish_reason or finish
                    for tc in ch.delta.tool_calls or []:
                        slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        slot["name"] += (tc.function.name or "") if tc.function else ""
                        slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            got = [(v["name"], v["arguments"]) for _, v in sorted(calls.items())]
        else:
            r = c.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            got = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]
        assert finish == "tool_calls" and len(got) == 1, got
        name, args = got[0]
        assert name in SCHEMAS and (choice == "required" or name == choice)
        _valid(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_and_json_in_responses(gateway: GatewayProc, stream: bool) -> None:
    c = openai_client(gateway)
    tools = [{"type": "function", **t} for t in (WEATHER, ADD)]
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kw = {"model": MODEL, "input": "Weather in Oslo?", "tools": tools, "tool_choice": choice,
              "temperature": 1.0, "max_output_tokens": 200, "store": False}
        if stream:
            with c.responses.stream(**kw) as s:
                resp = s.get_final_response()
        else:
            resp = c.responses.create(**kw)
        calls = [o for o in resp.output if o.type == "function_call"]
        assert len(calls) == 1 and (choice == "required" or calls[0].name == "get_weather")
        _valid(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    resp = c.responses.create(model=MODEL, input="Plan a trip.", temperature=1.0, max_output_tokens=300,
                              store=False, text={"format": {"type": "json_schema", "name": "trip",
                                                            "schema": gateway.trip, "strict": True}})
    _valid(json.loads(resp.output_text), gateway.trip)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_and_json_in_messages(gateway: GatewayProc, stream: bool) -> None:
    a = anthropic.Anthropic(base_url=gateway.url, api_key="EMPTY", max_retries=0, timeout=120)
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
             for t in (WEATHER, ADD)]
    for choice in ({"type": "any"}, {"type": "tool", "name": "add"}):
        kw = {"model": MODEL, "max_tokens": 200, "tools": tools, "tool_choice": choice,
              "messages": [{"role": "user", "content": "What is 2 + 3?"}], "extra_body": {"temperature": 1.0}}
        if stream:
            with a.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = a.messages.create(**kw)
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) == 1, msg.content
        assert choice["type"] == "any" or uses[0].name == "add"
        _valid(uses[0].input, SCHEMAS[uses[0].name])
    msg = a.messages.create(model=MODEL, max_tokens=300, messages=ASK, extra_body={"temperature": 1.0},
                            output_config={"format": {"type": "json_schema", "schema": gateway.trip}})
    _valid(json.loads(msg.content[0].text), gateway.trip)


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": 5}, "is not a valid JSON Schema"),
    ({"type": "integer", "multipleOf": 3}, "'multipleOf' cannot be enforced"),
    ({"type": "string", "pattern": "(ab"}, "'(ab' is not a 'regex'"),
    ({"type": "string", "pattern": "(?<=a)b"}, "Lookbehind is not supported"),  # Python's re takes it, xgrammar not
])
def test_what_cannot_be_honoured_is_a_400_in_each_api(gateway: GatewayProc, schema: dict, why: str) -> None:
    c = openai_client(gateway)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert why in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=8, store=False,
                           text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert why in e.value.body["message"]
    a = anthropic.Anthropic(base_url=gateway.url, api_key="EMPTY", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                          output_config={"format": {"type": "json_schema", "schema": schema}})
    assert e.value.body["type"] == "error" and why in e.value.body["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": schema}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, tools=tools, tool_choice="required")
    assert why in e.value.body["message"]


def test_a_constrained_turn_is_recorded_with_its_grammar(gateway: GatewayProc) -> None:
    """Its log-probs are the grammar-masked distribution's: the grammar is recorded on the turn (the trainer
    rebuilds the masks from it, tests/test_grammar_training.py) and its tokens are stored at loss mask 0 (for
    consumers that cannot); an unconstrained turn beside it is stored as before."""
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore

    c = openai_client(gateway)
    sid = f"structured-{os.getpid()}"
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                              extra_headers={"X-Session-Id": sid})
    c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, extra_headers={"X-Session-Id": sid + "-j"},
                              response_format={"type": "json_schema", "json_schema": {"name": "trip",
                                                                                      "schema": TRIP}})
    store = SQLiteTrajectoryStore(gateway.db_path)
    try:
        (plain,) = store.get_trajectories(sid)
        (constrained,) = store.get_trajectories(sid + "-j")
    finally:
        store.close()
    turn = plain.turns[-1]
    assert turn.grammar is None and set(plain.loss_mask[turn.output_start:turn.output_end]) == {1}
    turn = constrained.turns[-1]
    assert json.loads(turn.grammar["json_schema"])["required"] == TRIP["required"]
    assert set(constrained.loss_mask[turn.output_start:turn.output_end]) == {0}
    assert constrained.rollout_logprobs[turn.output_start:turn.output_end] != [0.0] * (turn.output_end - turn.output_start)
