"""Online learning pieces with real parts: a rule-based judge endpoint (a real OpenAI-compatible HTTP
server), the gateway process with ``--online`` over the real sgl-router and a CPU engine, the openai
SDK as the simulated user. A user's complaint turns the previous turn into a rewarded (-1) one-turn
sample with teacher log-probs from the hinted context; praise gives +1; side turns and last turns
are never judged."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slime_server.buffer.schema import Trajectory, Turn
from slime_server.online.feedback import sample_session_id, score_tokens, turn_sample
from slime_server.online.judge import majority, parse_vote
from slime_server.trainer.samples import to_train_sample, with_opd
from slime_server.trainer.settings import OPDWeights
from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    openai_client,
    running_gateway,
)
from tests._judge_helpers import HINT, running_judge

pytestmark = pytest.mark.timeout(300)


def test_parse_vote_and_majority() -> None:
    assert parse_vote("SCORE: +1") == (1, None)
    assert parse_vote("score: -1\nHINT: be brief ") == (-1, "be brief")
    assert parse_vote("SCORE: 0") == (0, None)
    assert parse_vote("no idea") == (0, None)
    assert majority([1, 1, -1]) == 1 and majority([1, -1]) == 0 and majority([-1, -1, 0]) == -1


def test_turn_sample_trains_only_that_turn() -> None:
    base = Trajectory(session_id="s", tokens=list(range(10)), loss_mask=[0, 0, 1, 1, 0, 0, 1, 1, 1, 0],
                      rollout_logprobs=[0, 0, -.1, -.2, 0, 0, -.3, -.4, -.5, 0],
                      weight_versions=[-1, -1, 3, 3, -1, -1, 4, 4, 4, -1],
                      turns=[Turn(response_id="a", prompt_start=0, output_start=2, output_end=4),
                             Turn(response_id="b", prompt_start=4, output_start=6, output_end=9)])
    s = turn_sample(base, 1, -1.0, {"teacher_logprobs": [0.0] * 6 + [-0.1, -0.2, -0.9]})
    assert s.tokens == list(range(9)) and s.loss_mask == [0] * 6 + [1, 1, 1]
    assert s.rollout_logprobs[6:] == [-.3, -.4, -.5] and s.weight_versions[:6] == [-1] * 6
    assert s.reward == -1.0 and s.status == "finished" and s.session_id == sample_session_id(base.id, 1)
    sample = with_opd([to_train_sample(s)], OPDWeights(w_rl=0.0, w_opd=1.0))[0]
    # the hinted teacher makes tokens 6 and 7 more likely than the student did (positive advantage), 8 less
    assert sample.advantages is not None
    assert sample.advantages[6:] == pytest.approx([0.2, 0.2, -0.4])
    assert sample.advantages[:6] == [0.0] * 6


@pytest.fixture(scope="module")
def judge() -> Iterator[tuple[str, list[str]]]:
    with running_judge() as j:
        yield j


@pytest.fixture(scope="module")
def online_gateway(router_url: str, tiny_model_path: Path, judge, tmp_path_factory) -> Iterator[GatewayProc]:
    d = tmp_path_factory.mktemp("online")
    with running_gateway(router_url, tiny_model_path, d / "traj.db", d / "gateway.log", "--online",
                         "--judge-url", judge[0]) as gw:
        yield gw


def _sample(gw: GatewayProc, session_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{gw.base_url}/sessions/{session_id}/trajectory", timeout=30)
        if r.status_code == 200 and r.json():
            return r.json()[0]
        time.sleep(0.2)
    raise AssertionError(f"no judged sample {session_id}")


def test_complaint_and_praise_become_judged_samples(online_gateway: GatewayProc, judge) -> None:
    gw = online_gateway
    client = openai_client(gw)
    sid = httpx.post(f"{gw.base_url}/sessions", json={}, timeout=30).json()["id"]
    hdr = {"X-Session-Id": sid}
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_headers=hdr)
    first = client.chat.completions.create(messages=messages, **kw)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "That is too long, shorter please."}]
    # a side call inside the session (e.g. a tool summarising something): served, never merged or judged
    side = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Summarise: waves."}], extra_headers={**hdr, "X-Turn-Type": "side"})
    assert side.choices[0].message is not None
    second = client.chat.completions.create(messages=messages, **kw)
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": "Thanks, great."}]
    client.chat.completions.create(messages=messages, **kw)

    trajs = httpx.get(f"{gw.base_url}/sessions/{sid}/trajectory", timeout=30).json()
    assert len(trajs) == 1 and len(trajs[0]["turns"]) == 3  # the side turn is not in the session
    main = trajs[0]
    bad = _sample(gw, sample_session_id(main["id"], 0))
    good = _sample(gw, sample_session_id(main["id"], 1))
    assert bad["reward"] == -1.0 and good["reward"] == 1.0
    t0 = main["turns"][0]
    assert bad["tokens"] == main["tokens"][: t0["output_end"]]
    assert sum(bad["loss_mask"]) == t0["output_end"] - t0["output_start"]
    assert bad["metadata"]["judge"] == {"score": -1, "votes": [-1], "hint": HINT}
    teacher = bad["metadata"]["teacher_logprobs"]
    assert len(teacher) == len(bad["tokens"])
    out = range(t0["output_start"], t0["output_end"])
    assert all(teacher[i] <= 0.0 for i in out) and any(abs(teacher[i] - bad["rollout_logprobs"][i]) > 1e-3
                                                       for i in out)  # the hint changes the context
    assert "teacher_logprobs" not in good["metadata"]  # no hint, no distillation term
    # the last turn has no next state; the side turn is never judged: 2 judge calls in all
    time.sleep(1.0)
    assert len(judge[1]) == 2
    with pytest.raises(AssertionError):
        _sample(gw, sample_session_id(main["id"], 2), timeout=1.0)


def test_unhinted_teacher_equals_the_student(router_url: str, online_gateway: GatewayProc) -> None:
    """Scoring the response under its own context reproduces the rollout log-probs: the teacher
    term is exactly the effect of the hint."""
    import asyncio

    client = openai_client(online_gateway)
    sid = httpx.post(f"{online_gateway.base_url}/sessions", json={}, timeout=30).json()["id"]
    client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, extra_headers={"X-Session-Id": sid},
                                   messages=[{"role": "user", "content": "Name a colour."}])
    traj = httpx.get(f"{online_gateway.base_url}/sessions/{sid}/trajectory", timeout=30).json()[0]
    t = traj["turns"][0]

    async def score() -> list[float]:
        async with httpx.AsyncClient(base_url=router_url, timeout=60) as http:
            return await score_tokens(http, traj["tokens"][: t["output_start"]],
                                      traj["tokens"][t["output_start"]:t["output_end"]])

    scored = asyncio.run(score())
    assert scored == pytest.approx(traj["rollout_logprobs"][t["output_start"]:t["output_end"]], abs=1e-4)
