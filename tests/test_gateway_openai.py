"""Acceptance: the real openai SDK against the gateway process, in front of the real sgl-router and
a CPU engine serving a tiny model fine-tuned (in the test) to call a tool."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests._gateway_helpers import (
    MODEL,
    TOOL_ARGS,
    TOOL_RESULT,
    TOOL_USER,
    WEATHER_TOOL,
    GatewayProc,
    new_session,
    openai_client,
    session_trajectories,
    start_gateway,
    stop_gateway,
)

pytestmark = pytest.mark.slow


def generated_positions(traj: dict) -> list[int]:
    return [i for t in traj["turns"] for i in range(t["output_start"], t["output_end"])]


def test_models(tool_gateway: GatewayProc) -> None:
    assert [m.id for m in openai_client(tool_gateway).models.list().data] == [MODEL]


def test_stream_equals_non_stream_and_usage_matches_store(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], temperature=0,
              max_tokens=24, seed=7)
    sid_a, sid_b = new_session(tool_gateway), new_session(tool_gateway)
    plain = client.chat.completions.create(**kw, extra_headers={"X-Session-Id": sid_a})
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                 extra_headers={"X-Session-Id": sid_b}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == (plain.choices[0].message.content or "")
    assert reasoning == (getattr(plain.choices[0].message, "reasoning_content", None) or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [plain.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert plain.id.startswith("chatcmpl-")
    for sid, usage in ((sid_a, plain.usage), (sid_b, chunks[-1].usage)):
        (traj,) = session_trajectories(tool_gateway, sid)
        (turn,) = traj["turns"]
        assert turn["output_start"] == usage.prompt_tokens
        assert turn["output_end"] - turn["output_start"] == usage.completion_tokens == sum(traj["loss_mask"])


def test_tool_call_round_trip_is_one_trajectory(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    sid = new_session(tool_gateway)
    hdr = {"X-Session-Id": sid}
    messages: list[dict] = [{"role": "user", "content": TOOL_USER}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0,
                                           max_tokens=40, extra_headers=hdr)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(TOOL_ARGS)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0,
                                            max_tokens=16, extra_headers=hdr)
    (traj,) = session_trajectories(tool_gateway, sid)
    assert len(traj["turns"]) == 2
    gen = generated_positions(traj)
    assert [i for i, m in enumerate(traj["loss_mask"]) if m] == gen
    assert len(gen) == first.usage.completion_tokens + second.usage.completion_tokens
    # the second prompt is the first trajectory's tokens + the tool result: nothing re-tokenized
    assert traj["turns"][1]["prompt_start"] == traj["turns"][0]["output_end"]
    assert second.usage.prompt_tokens == traj["turns"][1]["output_start"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_prefill_is_prompt_not_generated(tool_gateway: GatewayProc, tool_choice) -> None:
    client = openai_client(tool_gateway)
    sid = new_session(tool_gateway)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TOOL_USER}],
                                       tools=[WEATHER_TOOL], tool_choice=tool_choice, temperature=0, max_tokens=40,
                                       extra_headers={"X-Session-Id": sid})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(TOOL_ARGS)
    (traj,) = session_trajectories(tool_gateway, sid)
    (turn,) = traj["turns"]
    plain = openai_client(tool_gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": TOOL_USER}], tools=[WEATHER_TOOL], temperature=0,
        max_tokens=1)
    prefill_len = r.usage.prompt_tokens - plain.usage.prompt_tokens
    assert prefill_len > 0  # the prefill counts as prompt...
    assert turn["output_start"] == r.usage.prompt_tokens  # ...and is recorded with loss mask 0
    assert sum(traj["loss_mask"][: turn["output_start"]]) == 0
    assert turn["output_end"] - turn["output_start"] == r.usage.completion_tokens


def test_five_turns_one_trajectory_with_engine_logprobs(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    sid = new_session(tool_gateway)
    messages: list[dict] = [{"role": "system", "content": "Be brief."}]
    returned: list[float] = []
    for k in range(5):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"Question {k}?"}]})
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.8, seed=k, max_tokens=6,
                                           logprobs=True, top_logprobs=2, extra_headers={"X-Session-Id": sid})
        msg = r.choices[0].message
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
        returned += [t.logprob for t in r.choices[0].logprobs.content]
        messages.append(msg.model_dump(exclude_none=True))
    (traj,) = session_trajectories(tool_gateway, sid)
    assert len(traj["turns"]) == 5
    gen = generated_positions(traj)
    assert [i for i, m in enumerate(traj["loss_mask"]) if m] == gen
    assert [traj["rollout_logprobs"][i] for i in gen] == returned
    assert all(traj["rollout_logprobs"][i] == 0.0 for i, m in enumerate(traj["loss_mask"]) if not m)
    assert all(traj["weight_versions"][i] >= 0 for i in gen)


def test_drift_starts_a_counted_segment(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    sid = new_session(tool_gateway)
    hdr = {"X-Session-Id": sid}
    messages: list[dict] = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, seed=1, extra_headers=hdr)
    # the client rewrites the answer (an append could still be a token-exact extension of a cut answer)
    messages += [{"role": "assistant", "content": "EDITED " + (r.choices[0].message.content or "")},
                 {"role": "user", "content": "And?"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, seed=2, extra_headers=hdr)
    info = httpx.get(f"{tool_gateway.base_url}/sessions/{sid}", timeout=30).json()
    assert info["segment_splits"] == 1
    assert [t["segment"] for t in info["trajectories"]] == [0, 1]
    assert info["num_turns"] == 2


def test_reward_is_visible_and_idempotent(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    sid = new_session(tool_gateway, group_id="g1", metadata={"task": "t"})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                   extra_headers={"X-Session-Id": sid})
    url = f"{tool_gateway.base_url}/sessions/{sid}"
    r1 = httpx.post(f"{url}/reward", json={"reward": 1.0}, headers={"Idempotency-Key": "k1"}, timeout=30)
    assert r1.status_code == 200 and r1.json()["changed"] is True
    before = session_trajectories(tool_gateway, sid)
    r2 = httpx.post(f"{url}/reward", json={"reward": 1.0}, headers={"Idempotency-Key": "k1"}, timeout=30)
    assert r2.status_code == 200 and r2.json()["changed"] is False
    assert session_trajectories(tool_gateway, sid) == before
    assert before[0]["reward"] == 1.0
    assert httpx.post(f"{url}/reward", json={"reward": 0.0}, headers={"Idempotency-Key": "k1"},
                      timeout=30).status_code == 409
    assert httpx.post(f"{url}/close", timeout=30).json()["status"] == "closed"
    info = httpx.get(url, timeout=30).json()
    assert info["status"] == "closed" and info["rewards"] == [1.0] and info["group_id"] == "g1"
    with pytest.raises(openai.ConflictError):  # a closed session refuses new turns
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_headers={"X-Session-Id": sid})


def test_a_scalar_reward_finishes_its_session_unless_not_final(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    sid = new_session(tool_gateway)
    url = f"{tool_gateway.base_url}/sessions/{sid}"
    hi = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=3, extra_headers={"X-Session-Id": sid})
    r = httpx.post(f"{url}/reward", json={"reward": 0.5, "final": False}, timeout=30)
    assert r.status_code == 200 and r.json()["finished"] is False
    assert httpx.get(url, timeout=30).json()["status"] == "open"
    client.chat.completions.create(  # the episode goes on after a reward that is not final
        model=MODEL, messages=[*hi, first.choices[0].message.model_dump(exclude_none=True),
                               {"role": "user", "content": "More"}], max_tokens=3, extra_headers={"X-Session-Id": sid})
    r = httpx.post(f"{url}/reward", json={"reward": 1.0}, timeout=30)
    assert r.status_code == 200 and r.json()["finished"] is True
    info = httpx.get(url, timeout=30).json()
    assert info["status"] == "closed" and info["num_turns"] == 2
    assert [t["status"] for t in info["trajectories"]] == ["finished"]  # trainable now
    with pytest.raises(openai.ConflictError) as exc:
        client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, extra_headers={"X-Session-Id": sid})
    assert '"final": false' in exc.value.message  # the error says how to keep an episode going
    sid2 = new_session(tool_gateway)  # per-turn rewards may come as the episode goes on: they do not finish it
    client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, extra_headers={"X-Session-Id": sid2})
    r = httpx.post(f"{tool_gateway.base_url}/sessions/{sid2}/reward", json={"turn_rewards": [1.0]}, timeout=30)
    assert r.json()["finished"] is False and httpx.get(f"{tool_gateway.base_url}/sessions/{sid2}").json()["status"] == "open"


def test_idle_sessions_are_finished(tool_router_url: str, tool_model: Path, tmp_path: Path) -> None:
    gw = start_gateway(tool_router_url, tool_model, tmp_path / "traj.db", tmp_path / "gateway.log",
                       settings={"session_idle_timeout_s": 1.0})
    try:
        sid = new_session(gw)
        openai_client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=2, extra_headers={"X-Session-Id": sid})
        deadline = time.monotonic() + 30
        while (info := httpx.get(f"{gw.base_url}/sessions/{sid}", timeout=30).json())["status"] == "open":
            assert time.monotonic() < deadline, "the idle session was never closed"
            time.sleep(0.2)
        assert info["status"] == "closed" and [t["status"] for t in info["trajectories"]] == ["finished"]
        metrics = httpx.get(f"{gw.url}/metrics", timeout=30).text
        assert "slime_sessions_idle_closed_total 1.0" in metrics
    finally:
        stop_gateway(gw)


def test_feedback_and_completions(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    fb = httpx.post(f"{tool_gateway.base_url}/responses/{r.id}/feedback", json={"thumb": "up"}, timeout=30)
    assert fb.status_code == 200, fb.text
    assert httpx.post(f"{tool_gateway.base_url}/responses/chatcmpl-nope/feedback", json={"thumb": "up"},
                      timeout=30).status_code == 404
    sid = new_session(tool_gateway)
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=1,
                                  extra_headers={"X-Session-Id": sid})
    assert c.usage.completion_tokens == len(c.choices[0].logprobs.token_logprobs)
    (traj,) = session_trajectories(tool_gateway, sid)
    assert sum(traj["loss_mask"]) == c.usage.completion_tokens
    assert len(traj["tokens"]) == c.usage.prompt_tokens + c.usage.completion_tokens


def test_n_choices_are_sibling_branches_streamed_or_not(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    for stream in (False, True):
        sid = new_session(tool_gateway)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5, seed=3,
                  extra_headers={"X-Session-Id": sid})
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                     for i in range(2)]
            usage = chunks[-1].usage
        else:
            r = client.chat.completions.create(**kw)
            texts = [c.message.content or "" for c in r.choices]
            usage = r.usage
        trajs = session_trajectories(tool_gateway, sid)
        assert sorted(t["branch"] for t in trajs) == [0, 1]
        assert sum(sum(t["loss_mask"]) for t in trajs) == usage.completion_tokens
        assert len(texts) == 2


def test_stream_equals_non_stream_with_a_stop_string(tool_gateway: GatewayProc) -> None:
    client = openai_client(tool_gateway)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], temperature=0, max_tokens=24)
    text = client.chat.completions.create(**kw).choices[0].message.content or ""
    assert len(text) > 8
    stop = text[len(text) // 2: len(text) // 2 + 3]  # appears mid-text: generation must stop before it
    plain = client.chat.completions.create(**kw, stop=[stop]).choices[0].message.content or ""
    chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert stop not in plain and text.startswith(plain)
    assert streamed == plain
