"""Issue 46: ``data.source: verifiers``. A GRPO job on a verifiers environment (verifiers 0.3.x, the classic API)
plays the environment's rollouts through /v1 in sessions and groups, its rubric's rewards become the sessions'
rewards, and it trains and pushes: a single-turn environment (the shipped example, reverse-text) and a multi-turn
one with a tool (``tests/_vf_tool_env.py``). A bad environment or arguments is a 400 at submit naming it."""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._jobs_helpers import admin, cancel, drain_pool, running_stack, wait_event, wait_job

PACED = {"max_buffered": 8, "retry_after_s": 0.25}
LOOP = {"batch_size": 4, "n_samples_per_prompt": 2, "max_staleness": None, "poll_interval_s": 0.05,
        "checkpoint_interval": 100}


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_stack(tiny_model_path, tmp_path_factory.mktemp("vf")) as running:
        yield running


def submit(server: Any, data: dict[str, Any], **more: Any) -> Any:
    body = {"name": "vf", "algorithm": "grpo", "optimizer": {"lr": 1e-3}, "loop": LOOP, "pacing": PACED,
            "data": {"source": "verifiers", "concurrency": 4, **data}, **more}
    with admin(server) as c:
        return c.post("/jobs", json=body)


def evals_of(server: Any, job_id: str) -> list[dict[str, Any]]:
    with admin(server) as c:
        return c.get(f"/jobs/{job_id}/evals").raise_for_status().json()["data"]


def train_three_steps(server: Any, data: dict[str, Any], **more: Any) -> tuple[dict[str, Any], list[Any]]:
    """Run the job to 3 steps and a push (and, with eval sets, their rounds at steps 0 and 2); its trained
    trajectories (whole groups of 2, the environment's)."""
    drain_pool(server)
    r = submit(server, data, **more)
    assert r.status_code == 200, r.text
    j = r.json()
    j = wait_job(server, j["id"], lambda j: j["step"] >= 3, timeout=240)
    assert wait_event(server, j["id"], "weights_pushed")["data"]["bytes"] > 0
    episodes = wait_event(server, j["id"], "episodes")["data"]
    deadline = time.monotonic() + 120
    while more.get("eval") and not {0, 2} <= {e["step"] for e in evals_of(server, j["id"])}:
        assert time.monotonic() < deadline, evals_of(server, j["id"])
        time.sleep(0.3)
    cancel(server, j["id"])
    store = server.gateway.server.config.app.state.gw.store
    env = f"verifiers:{data['environment']}"
    trained = [t for t in store.list_trajectories(limit=10_000) if t.consumed_job == j["id"]
               and (t.consumed_step or 0) > 0 and store.get_session(t.session_id).metadata.get("env") == env]
    by_group: dict[str, int] = {}
    for t in trained:
        by_group[t.group_id or t.id] = by_group.get(t.group_id or t.id, 0) + 1
    assert len(by_group) >= 3 * 4 // 2 and set(by_group.values()) == {2}  # 3 steps of 4 samples, whole groups
    assert episodes["errors"] == 0
    return {**episodes, "job": j["id"]}, trained


def test_single_turn_environment_trains_on_its_rubric(server: Any) -> None:
    """... and is evaluated on a verifiers environment's rows (4, greedy, before training and after step 2):
    serve-only sessions, never rewarded."""
    held_out = {"name": "vf-held", "source": "verifiers", "environment": "slime_server.envs.vf_reverse_text",
                "env_args": {"num_rows": 8, "seed": 99}, "num_prompts": 4, "every_steps": 2, "max_tokens": 16}
    episodes, trained = train_three_steps(server, {"environment": "slime_server.envs.vf_reverse_text",
                                                   "env_args": {"num_rows": 32, "seed": 3}, "max_tokens": 16,
                                                   "num_prompts": 5}, eval=[held_out])
    store = server.gateway.server.config.app.state.gw.store
    rows = {store.get_session(t.session_id).metadata["example_id"] for t in trained}
    assert len(rows) <= 5  # data.num_prompts: 5 of the 32 rows (else 6+ trained groups, each its own row)
    evals = {e["step"]: e for e in evals_of(server, episodes["job"])}
    assert all(evals[s]["name"] == "vf-held" and evals[s]["episodes"] == 4 and evals[s]["errors"] == 0
               for s in (0, 2))
    assert 0 < evals[0]["mean_reward"] < 1  # the reverse-text rubric's share, greedy
    evaluated = [t for t in store.list_trajectories(limit=10_000)
                 if store.get_session(t.session_id).metadata.get("serve_only")]
    assert len(evaluated) >= 8 and all(t.reward is None for t in evaluated)
    for t in trained:  # the session's reward is the rubric's: reverse-text's LCS ratio of the recorded answer
        user, answer = t.messages[-2], t.messages[-1]
        assert [m.role for m in t.messages] == ["system", "user", "assistant"] and len(t.turns) == 1
        expected = difflib.SequenceMatcher(None, answer.content.strip(), user.content[::-1]).ratio()
        assert t.reward == pytest.approx(expected, abs=1e-9), (answer.content, user.content)
    assert len({t.reward for t in trained}) > 1  # partial credit: groups differ, so GRPO has advantages
    assert set(episodes["metrics"]) == {"lcs_ratio", "num_turns"} and episodes["metrics"]["num_turns"] == 1.0


def test_multi_turn_environment_with_a_tool_trains_on_its_rubric(server: Any) -> None:
    """The tool environment's loop runs unmodified against /v1: a forced call (data.sampling_args), the tool's
    answer, a second turn; both turns are one trajectory of the session, rewarded by the environment's rubric."""
    episodes, trained = train_three_steps(server, {"environment": "tests._vf_tool_env", "env_args": {"num_rows": 16},
                                                   "sampling_args": {"tool_choice": "required"}, "max_tokens": 64})
    called = 0
    for t in trained:
        first = next(m for m in t.messages if m.role == "assistant")
        if not first.tool_calls:  # the random model's call ran past max_tokens (JSON allows whitespace runs)
            assert len(t.turns) == 1 and t.reward == 0.0  # no call: the episode ended, and the rubric gave 0
            continue
        called += 1
        word = json.loads(first.tool_calls[0].arguments)["text"]
        asked = next(m for m in t.messages if m.role == "user").content.split()[3]
        tool = next(m for m in t.messages if m.role == "tool")
        assert first.tool_calls[0].name == "reverse" and tool.content == word[::-1]  # the environment's tool ran
        assert len(t.turns) == 2  # the tool's answer, then the second turn (the environment's max_turns)
        assert t.reward == pytest.approx(difflib.SequenceMatcher(None, word, asked).ratio(), abs=1e-9)
    assert called >= len(trained) // 2 and len({t.reward for t in trained}) > 1
    assert {"passed_the_word", "total_tool_calls", "reverse_calls", "num_turns"} <= set(episodes["metrics"])
    assert 0 < episodes["metrics"]["total_tool_calls"] <= 2


def test_an_unknown_environment_or_bad_arguments_is_a_400_naming_it(server: Any) -> None:
    cases = [
        ({"environment": "owner/no-such-env"}, "'owner/no-such-env' is not installed (no module 'no_such_env')"),
        ({}, "needs data.environment"),
        ({"environment": "slime_server.envs.vf_reverse_text", "env_args": {"bogus": 1}},
         "unexpected keyword argument 'bogus'"),
        ({"environment": "slime_server.envs.vf_reverse_text", "env_args": {"num_rows": 0}},
         "num_rows and max_words must be >= 1"),
        ({"environment": "json"}, "has no load_environment()"),
        ({"environment": "slime_server.envs.vf_reverse_text", "sampling_args": {"temperature": 0.5}},
         "['temperature']: the job sets these"),
    ]
    for data, message in cases:
        r = submit(server, data)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (data, r.text)
    unknown = {"name": "x", "source": "verifiers", "environment": "no-such-env"}
    r = submit(server, {"environment": "slime_server.envs.vf_reverse_text"}, eval=[unknown])
    assert r.status_code == 400 and "'no-such-env' is not installed" in r.json()["error"]["message"], r.text
    with admin(server) as c:
        r = c.post("/jobs", json={"data": {"source": "dataset", "environment": "calculator", "env_args": {"a": 1}}})
    assert r.status_code == 400 and "for data.source 'verifiers'" in r.json()["error"]["message"]
