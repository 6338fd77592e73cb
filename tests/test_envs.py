"""Environments and reward functions: schemas valid, correct episodes reward 1, wrong ones 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from slime_server.envs.base import DatasetRow, Environment, get_environment, load_jsonl
from slime_server.envs.calculator import CalculatorEnv, CalculatorError, evaluate
from slime_server.envs.rewards import (
    exact_match,
    has_answer_format,
    last_number,
    math_answer_match,
    numeric_match,
)


def test_calculator_tool_schema_is_valid_json_schema() -> None:
    env = get_environment("calculator")
    [tool] = env.tools()
    assert tool["type"] == "function" and tool["function"]["name"] == "calculator"
    jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    jsonschema.validate({"expression": "1+2"}, tool["function"]["parameters"])


def test_calculator_evaluates_arithmetic_and_refuses_everything_else() -> None:
    assert evaluate("(3 + 4) * 2") == 14
    assert evaluate("2^10") == 1024 and evaluate("7 / 2") == 3.5 and evaluate("-3 + +2") == -1
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "1 / 0", "'a' * 3", "1" * 300, "[1, 2]", "True + 1",
                "3if 1 else 2", "3in 4"):
        with pytest.raises(CalculatorError):
            evaluate(bad)


def test_an_expression_python_warns_of_prints_nothing() -> None:
    """``3in 4`` parses with a SyntaxWarning on stderr; the tool refuses it and the process prints nothing (README's
    first job printed Python's warning line in a CI run)."""
    code = ("from slime_server.envs.calculator import CalculatorError, evaluate\n"
            "for e in ('3in 4', '1or 2', '3if 1 else 2'):\n"
            "    try:\n        evaluate(e)\n    except CalculatorError:\n        print('refused')\n")
    done = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.split(), done.stderr) == (0, ["refused"] * 3, "")


def test_calculator_episode_correct_gets_1_wrong_gets_0() -> None:
    env = CalculatorEnv()
    row = env.default_dataset(1, seed=7)[0]
    state = env.reset(row)
    assert state.messages[0]["role"] == "system" and state.messages[-1]["content"] == row.prompt
    answer = env.step(state, "calculator", json.dumps({"expression": row.metadata["expression"]}))
    assert answer == row.label and state.tool_calls == 1
    assert env.reward(state, f"The answer is {answer}.") == 1.0
    assert env.reward(state, f"The answer is {int(float(answer)) + 1}.") == 0.0
    assert env.reward(state, "I do not know.") == 0.0
    assert env.step(state, "calculator", "{not json").startswith("error:")
    assert env.step(state, "search", "{}").startswith("error: unknown tool")
    assert env.step(state, "calculator", json.dumps({"expression": "1/0"})) == "error: division by zero"


def test_default_dataset_is_deterministic_and_labels_match_expressions() -> None:
    env = CalculatorEnv()
    a, b = env.default_dataset(20, seed=3), env.default_dataset(20, seed=3)
    assert a == b and a != env.default_dataset(20, seed=4)
    for row in a:
        assert numeric_match(row.label, evaluate(row.metadata["expression"])) == 1.0


def test_reward_functions() -> None:
    assert exact_match("  Paris. ", "paris") == 1.0 and exact_match("Lyon", "Paris") == 0.0
    assert last_number("a 1,234.5 then 7") == 7 and last_number("none") is None
    assert numeric_match("so 12", 12) == 1.0 and numeric_match("so 12.5", "12") == 0.0
    assert numeric_match("3/4", "0.75") == 1.0
    assert math_answer_match("thus \\boxed{42}, not 41", 42) == 1.0
    assert math_answer_match("<answer>x+1</answer>", "X+1") == 1.0
    assert has_answer_format("\\boxed{1}") == 1.0 and has_answer_format("1") == 0.0


def test_custom_environment_by_path_and_jsonl_rows(tmp_path: Path) -> None:
    env = get_environment("slime_server.envs.calculator:CalculatorEnv")
    assert isinstance(env, Environment)
    with pytest.raises(ValueError, match="unknown environment"):
        get_environment("nope")
    # every bad reference is a ValueError (a 400 for a job spec, found by the OpenAPI fuzzer), never a crash
    for bad in ("no_such_module_xyz:Env", ":Env", "slime_server.envs.calculator:Nope",
                "slime_server.envs.base:load_jsonl", "slime_server.envs.rewards:exact_match"):
        with pytest.raises(ValueError):
            get_environment(bad)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "label": "4"}) + "\n\n"
                 + json.dumps({"prompt": "3+3?", "label": 6, "metadata": {"k": 1}}) + "\n")
    rows = load_jsonl(p)
    assert rows == [DatasetRow(prompt=[{"role": "user", "content": "2+2?"}], label="4"),
                    DatasetRow(prompt="3+3?", label=6, metadata={"k": 1})]
    p.write_text('{"label": 1}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        load_jsonl(p)
