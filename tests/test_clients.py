"""Ecosystem fit: LangChain's ``ChatOpenAI`` (tools bound) and the OpenAI Agents SDK (``agents``)
run a tool-using agent against ``/v1`` and every call lands token-exactly in one trajectory.

The engine serves the tiny model fine-tuned to call ``get_weather`` (as in test_gateway_openai), so
the tool path is real: the client parses the call, runs the tool, sends the result back.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests._gateway_helpers import (
    MODEL,
    TOOL_RESULT,
    TOOL_USER,
    WEATHER_TOOL,
    GatewayProc,
)

pytestmark = pytest.mark.timeout(300)
SYSTEM = "You are a helpful assistant."  # the agents' instructions


def _session(gw: GatewayProc) -> str:
    return httpx.post(f"{gw.base_url}/sessions", json={}, timeout=30).raise_for_status().json()["id"]


def _trajectories(gw: GatewayProc, sid: str) -> list[dict]:
    return httpx.get(f"{gw.base_url}/sessions/{sid}/trajectory", timeout=30).raise_for_status().json()


def _check_token_exact(traj: dict, tool_model: Path, conversation: list[dict], tools: list[dict]) -> list[str]:
    """Re-renders, with HF's ``apply_chat_template`` (not the server's renderer), what the client sent:
    ``conversation`` is the messages of its last request (``tools`` as it sent them). The first prompt's
    stored ids are exactly the template's ids for the first request; every later turn's context (the
    tokens between the previous turn's output and its own) is exactly the tail of the template's text for
    that request, and holds the messages added since; the generated spans carry mask 1 and an engine
    log-prob, and nothing else does. Returns the decoded generated spans."""
    tok = AutoTokenizer.from_pretrained(tool_model)
    assistants = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    requests = [conversation[:i] for i in assistants] + [conversation]
    turns, tokens = traj["turns"], traj["tokens"]
    assert len(turns) == len(requests)
    first = tok.apply_chat_template(requests[0], tools=tools, add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"]
    assert tokens[: turns[0]["output_start"]] == list(first)
    for k in range(1, len(turns)):
        context = tok.decode(tokens[turns[k - 1]["output_end"]: turns[k]["output_start"]], skip_special_tokens=False)
        full = tok.apply_chat_template(requests[k], tools=tools, add_generation_prompt=True, tokenize=False)
        assert context and full.endswith(context), (context, full[-len(context) - 40:])
        for m in requests[k][assistants[k - 1] + 1:]:
            assert m["content"] in context
    mask, lps = traj["loss_mask"], traj["rollout_logprobs"]
    spans = []
    for t in turns:
        assert all(mask[i] == 1 and lps[i] <= 0.0 for i in range(t["output_start"], t["output_end"]))
        assert not any(mask[t["prompt_start"]:t["output_start"]])
        spans.append(tok.decode(tokens[t["output_start"]:t["output_end"]], skip_special_tokens=False))
    assert sum(mask) == sum(t["output_end"] - t["output_start"] for t in turns)
    return spans


def _weather_call_and_result(system: str | None = None) -> list[dict]:
    """What a client sends after the model called get_weather(city="Paris") and the tool answered."""
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": TOOL_USER},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": TOOL_RESULT}]


def get_weather(city: str) -> str:
    """Weather for a city"""
    return TOOL_RESULT


def test_langchain_chat_openai_with_bound_tools(tool_gateway: GatewayProc, tool_model: Path) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    sid = _session(tool_gateway)
    llm = ChatOpenAI(model=MODEL, base_url=tool_gateway.base_url, api_key="EMPTY", temperature=0, max_tokens=48,
                     max_retries=0, default_headers={"X-Session-Id": sid})
    agent_llm = llm.bind_tools([WEATHER_TOOL])
    messages: list = [HumanMessage(TOOL_USER)]
    first = agent_llm.invoke(messages)
    assert [c["name"] for c in first.tool_calls] == ["get_weather"]
    assert first.tool_calls[0]["args"] == {"city": "Paris"}
    messages += [first, ToolMessage(get_weather(**first.tool_calls[0]["args"]), tool_call_id=first.tool_calls[0]["id"])]
    final = agent_llm.invoke(messages)
    assert isinstance(final.content, str)
    trajs = _trajectories(tool_gateway, sid)
    assert len(trajs) == 1  # call, tool result and answer merged into one trajectory
    spans = _check_token_exact(trajs[0], tool_model, _weather_call_and_result(), [WEATHER_TOOL])
    assert "<tool_call>" in spans[0] and json.loads(spans[0].split("<tool_call>")[1].split("</tool_call>")[0]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert final.content.strip() and final.content in spans[1]  # a real answer, and the one stored


def test_openai_agents_sdk_runs_a_tool_using_agent(tool_gateway: GatewayProc, tool_model: Path) -> None:
    from agents import (
        Agent,
        FunctionTool,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    sid = _session(tool_gateway)
    calls: list[str] = []

    async def invoke(ctx: object, args_json: str) -> str:
        calls.append(json.loads(args_json)["city"])
        return TOOL_RESULT

    fn = WEATHER_TOOL["function"]
    weather = FunctionTool(name=fn["name"], description=fn["description"], params_json_schema=fn["parameters"],
                           on_invoke_tool=invoke, strict_json_schema=False)

    async def run() -> str:
        client = AsyncOpenAI(base_url=tool_gateway.base_url, api_key="EMPTY", max_retries=0,
                             default_headers={"X-Session-Id": sid})
        agent = Agent(name="weather", instructions=SYSTEM, tools=[weather],
                      model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=48))
        try:
            result = await Runner.run(agent, TOOL_USER, max_turns=3)
        finally:
            await client.close()
        return str(result.final_output)

    final = asyncio.run(run())
    assert calls == ["Paris"]  # the SDK parsed the model's call and ran the tool
    trajs = _trajectories(tool_gateway, sid)
    assert len(trajs) == 1
    agents_tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": False}}  # as the SDK sends it
    spans = _check_token_exact(trajs[0], tool_model, _weather_call_and_result(SYSTEM), [agents_tool])
    assert '"get_weather"' in spans[0]
    assert final.strip() and final in spans[1]  # a real answer, and the one stored


def test_openai_agents_sdk_with_the_responses_model(tool_gateway: GatewayProc, tool_model: Path) -> None:
    """The Agents SDK's default model speaks the Responses API (issue 21). The agent stops on its tool's
    output: after the tool result the tiny model rambles to the token limit, which the Responses API
    reports as ``incomplete`` and this SDK (rightly) raises on; the round trip of a tool result through
    Responses is tested with the plain SDK in test_responses_api.py."""
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    sid = _session(tool_gateway)
    calls: list[str] = []

    async def invoke(ctx: object, args_json: str) -> str:
        calls.append(json.loads(args_json)["city"])
        return TOOL_RESULT

    fn = WEATHER_TOOL["function"]
    weather = FunctionTool(name=fn["name"], description=fn["description"], params_json_schema=fn["parameters"],
                           on_invoke_tool=invoke, strict_json_schema=False)

    async def run() -> str:
        client = AsyncOpenAI(base_url=tool_gateway.base_url, api_key="EMPTY", max_retries=0,
                             default_headers={"X-Session-Id": sid})
        agent = Agent(name="weather", instructions=SYSTEM, tools=[weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=48), tool_use_behavior="stop_on_first_tool")
        try:
            result = await Runner.run(agent, TOOL_USER, max_turns=3)
        finally:
            await client.close()
        return str(result.final_output)

    final = asyncio.run(run())
    assert calls == ["Paris"] and final == TOOL_RESULT  # the SDK parsed our function_call item and ran the tool
    trajs = _trajectories(tool_gateway, sid)
    assert len(trajs) == 1
    responses_tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": False}}
    (span,) = _check_token_exact(trajs[0], tool_model, _weather_call_and_result(SYSTEM)[:2], [responses_tool])
    assert json.loads(span.split("<tool_call>")[1].split("</tool_call>")[0]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}


def test_langchain_chat_anthropic_with_bound_tools(tool_gateway: GatewayProc, tool_model: Path) -> None:
    """LangChain's ChatAnthropic (the Anthropic SDK underneath) against /v1/messages (issue 21)."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage

    sid = _session(tool_gateway)
    llm = ChatAnthropic(model=MODEL, base_url=tool_gateway.url, api_key="EMPTY", max_tokens=48, max_retries=0,
                        default_headers={"X-Session-Id": sid}, model_kwargs={"extra_body": {"temperature": 0}})
    agent_llm = llm.bind_tools([WEATHER_TOOL])
    messages: list = [HumanMessage(TOOL_USER)]
    first = agent_llm.invoke(messages)
    assert [c["name"] for c in first.tool_calls] == ["get_weather"]
    assert first.tool_calls[0]["args"] == {"city": "Paris"}
    messages += [first, ToolMessage(get_weather(**first.tool_calls[0]["args"]), tool_call_id=first.tool_calls[0]["id"])]
    final = agent_llm.invoke(messages)
    trajs = _trajectories(tool_gateway, sid)
    assert len(trajs) == 1  # call, tool result and answer merged into one trajectory
    spans = _check_token_exact(trajs[0], tool_model, _weather_call_and_result(), [WEATHER_TOOL])
    assert json.loads(spans[0].split("<tool_call>")[1].split("</tool_call>")[0]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    text = final.content if isinstance(final.content, str) else "".join(
        b.get("text", "") for b in final.content if isinstance(b, dict))
    assert text.strip() and text in spans[1]
