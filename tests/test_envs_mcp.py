"""The MCP adapter against a real stdio MCP server process: its tools become the environment's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from slime_server.envs.base import DatasetRow
from slime_server.envs.mcp import MCPEnvironment, MCPError

SERVER = [sys.executable, str(Path(__file__).with_name("_mcp_echo_server.py"))]


@pytest.fixture
def env():
    e = MCPEnvironment(SERVER, rows=[DatasetRow(prompt="What is 2 + 3?", label="5")])
    yield e
    e.close()


def test_mcp_tools_are_listed_as_valid_function_tools(env: MCPEnvironment) -> None:
    names = [t["function"]["name"] for t in env.tools()]
    assert names == ["add", "shout"]
    for t in env.tools():
        jsonschema.Draft202012Validator.check_schema(t["function"]["parameters"])
    assert env.client.server_info["name"] == "echo"


def test_mcp_episode_calls_tools_and_scores(env: MCPEnvironment) -> None:
    state = env.reset(env.default_dataset(1)[0])
    assert env.step(state, "add", json.dumps({"a": 2, "b": 3})) == "5"
    assert env.step(state, "shout", json.dumps({"text": "hi"})) == "HI"
    assert env.step(state, "nope", "{}").startswith("error: unknown tool")
    assert env.reward(state, "<answer>5</answer>") == 1.0 and env.reward(state, "<answer>6</answer>") == 0.0
    with pytest.raises(MCPError):
        env.client.request("resources/list")
