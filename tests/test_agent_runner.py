"""The agent runner against a running gateway (real router, CPU engine): 16 episodes in groups of 4 leave 16
rewarded, finished trajectories in 4 groups in the buffer; against a scripted upstream, what it retries."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from slime_server.agents.runner import AgentRunner, RunnerSettings, RunSummary
from slime_server.envs.calculator import CalculatorEnv
from tests._gateway_helpers import GatewayProc

pytestmark = pytest.mark.timeout(300)


def test_sixteen_episodes_in_four_groups_are_recorded_with_rewards(gateway: GatewayProc) -> None:
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


def test_agent_cli_runs_and_reports(gateway: GatewayProc, capsys: pytest.CaptureFixture[str]) -> None:
    from slime_server.cli import main

    code = main(["agent", "run", "--env", "calculator", "--base-url", gateway.base_url, "--num-prompts", "2",
                 "--n-samples", "2", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["episodes"] == 4 and summary["groups"] == 2 and summary["errors"] == 0
    assert main(["agent", "run", "--env", "no-such-env", "--base-url", gateway.base_url]) == 2


def _paced_upstream(refusals: int, status: int = 429):
    """An upstream that refuses ``refusals`` times (by default buffer pacing: 429 + Retry-After) before serving:
    the server's side is not the unit here, the runner's reaction is."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()
    calls = {"chat": 0}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/sessions")
    def session() -> dict:
        return {"id": "s1"}

    @app.post("/v1/sessions/{sid}/reward")
    @app.post("/v1/sessions/{sid}/close")
    def ok(sid: str) -> dict:
        return {"ok": True}

    @app.post("/v1/chat/completions")
    def chat() -> JSONResponse:
        calls["chat"] += 1
        if calls["chat"] <= refusals:
            return JSONResponse({"error": {"message": f"refused ({status})", "type": "rate_limit_error", "param": None,
                                           "code": "buffer_full"}}, status_code=status, headers={"Retry-After": "0.05"})
        return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "The answer is 7."}}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    return app, calls


def _run_against(app, **settings) -> RunSummary:
    import threading
    import time

    import uvicorn

    from slime_server.envs.base import DatasetRow
    from slime_server.utils.net import find_free_port

    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        runner = AgentRunner(CalculatorEnv(), RunnerSettings(base_url=f"http://127.0.0.1:{port}/v1",
                                                             n_samples_per_prompt=1, **settings))
        return asyncio.run(runner.run([DatasetRow(prompt="Ana has 4 apples and buys 3 more.", label="7")]))
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("wait", [True, False])
def test_pacing_is_waited_out_not_failed(wait: bool) -> None:
    app, calls = _paced_upstream(refusals=6)
    summary = _run_against(app, max_retries=1, wait_when_paced=wait)
    if wait:  # six refusals, more than the retries allowed: still one successful, rewarded episode
        assert summary.errors == 0 and summary.results[0].reward == 1.0 and calls["chat"] == 7
    else:  # the first refusal and its one retry
        assert summary.errors == 1 and "RateLimitError" in (summary.results[0].error or "") and calls["chat"] == 2


@pytest.mark.parametrize(("status", "retries", "calls_made", "ok"), [
    (503, 2, 3, True),  # a server failure twice, two retries: the third call is answered
    (502, 1, 2, False),  # twice, one retry: the episode fails with the server's answer
    (400, 5, 1, False),  # a refusal is never repeated
    (409, 5, 1, False),  # nor a closed session's conflict
])
def test_server_failures_are_retried_refusals_are_not(status: int, retries: int, calls_made: int, ok: bool) -> None:
    app, calls = _paced_upstream(refusals=2, status=status)
    summary = _run_against(app, max_retries=retries)
    assert calls["chat"] == calls_made
    if ok:
        assert summary.errors == 0 and summary.results[0].reward == 1.0
    else:
        assert summary.errors == 1 and f"Error code: {status}" in (summary.results[0].error or "")
        assert f"refused ({status})" in (summary.results[0].error or "")
