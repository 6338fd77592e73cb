"""The agent runner against a running gateway (real router, CPU engine, openai SDK): 16 episodes in
groups of 4 leave 16 rewarded, finished trajectories in 4 groups in the buffer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from _gateway_helpers import GatewayProc, gateway, router_url  # noqa: F401

from slime_server.agents.runner import AgentRunner, RunnerSettings
from slime_server.envs.calculator import CalculatorEnv

pytestmark = pytest.mark.timeout(300)


def test_sixteen_episodes_in_four_groups_are_recorded_with_rewards(gateway: GatewayProc) -> None:  # noqa: F811
    env = CalculatorEnv()
    rows = env.default_dataset(4, seed=1)
    runner = AgentRunner(env, RunnerSettings(base_url=gateway.base_url, n_samples_per_prompt=4, concurrency=8,
                                             max_tokens=24, seed=0))
    seen = []
    summary = asyncio.run(runner.run(rows, on_episode=seen.append))
    assert summary.episodes == 16 and summary.groups == 4 and summary.errors == 0 and len(seen) == 16
    groups: dict[str, list[float]] = {}
    for r in summary.results:
        trajs = httpx.get(f"{gateway.base_url}/sessions/{r.session_id}/trajectory", timeout=10).json()
        assert len(trajs) >= 1
        for t in trajs:
            assert t["status"] == "finished" and t["reward"] == r.reward and t["group_id"] == r.group_id
            assert sum(t["loss_mask"]) > 0
        groups.setdefault(r.group_id, []).append(r.reward)
    assert sorted(len(v) for v in groups.values()) == [4, 4, 4, 4]


def test_agent_cli_runs_and_reports(gateway: GatewayProc, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    from slime_server.cli import main

    code = main(["agent", "run", "--env", "calculator", "--base-url", gateway.base_url, "--num-prompts", "2",
                 "--n-samples", "2", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["episodes"] == 4 and summary["groups"] == 2 and summary["errors"] == 0
    assert main(["agent", "run", "--env", "no-such-env", "--base-url", gateway.base_url]) == 2
