"""Partial rollouts and surplus aborts through the real gateway, router and CPU engine.

- An engine that aborts a generation on its own (``/pause_generation {"mode": "abort"}``, as for a
  weight update) does not fail the client: the gateway continues from the tokens so far and the
  greedy answer equals the uninterrupted one, token for token.
- ``POST /v1/sessions/{id}/abort`` stops that session's generation for good (over-sampling
  surplus); the partial turn is recorded.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests._gateway_helpers import MODEL, GatewayProc, openai_client

pytestmark = pytest.mark.timeout(300)

PROMPT = [{"role": "user", "content": "Tell me a long story."}]
# what the aborts below stop: as long as the tiny model's context allows, so that it is still generating when the
# abort comes (CI's 400 tokens were done within the test's 0.2 s wait once the CPU engine got faster)
LONG = 3500
CONTINUED = 1000  # the continued answers: long enough that the abort lands mid-generation on the fast engine


def _engine_url(router: str) -> str:
    return httpx.get(f"{router}/workers", timeout=10).json()["workers"][0]["url"]


def _load(engine: str) -> dict:
    return httpx.get(f"{engine}/get_server_info", timeout=10).json()["internal_states"][0]


def _wait_for(engine: str, key: str, timeout: float = 30) -> None:
    """Until the engine reports at least one request under ``key`` (num_running_reqs, num_waiting_reqs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _load(engine)
        if info[key]:
            return
        time.sleep(0.01)
    raise AssertionError(f"no request in {key}: {info}")


def _counter(gw: GatewayProc, name: str) -> float:
    for line in httpx.get(f"{gw.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_engine_abort_is_continued_and_equals_the_uninterrupted_answer(gateway: GatewayProc,
                                                                        router_url: str) -> None:
    client = openai_client(gateway)
    kw = dict(model=MODEL, messages=PROMPT, max_tokens=CONTINUED, temperature=0, extra_body={"ignore_eos": True})
    reference = client.chat.completions.create(**kw)
    assert reference.usage.completion_tokens == CONTINUED
    engine = _engine_url(router_url)
    before = _counter(gateway, "slime_partial_rollout_continuations_total")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=client.chat.completions.create(
        **kw, extra_headers={"X-Session-Id": "partial-1"})))
    t.start()
    _wait_for(engine, "num_running_reqs")
    httpx.post(f"{engine}/pause_generation", json={"mode": "abort"}, timeout=10).raise_for_status()
    time.sleep(0.3)
    httpx.post(f"{engine}/continue_generation", json={}, timeout=10).raise_for_status()
    t.join(120)
    r = result["r"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == CONTINUED
    assert r.choices[0].message.content == reference.choices[0].message.content
    assert _counter(gateway, "slime_partial_rollout_continuations_total") >= before + 1
    traj = httpx.get(f"{gateway.base_url}/sessions/partial-1/trajectory", timeout=10).json()
    assert len(traj) == 1 and sum(traj[0]["loss_mask"]) == CONTINUED
    assert all(lp <= 0 for lp, m in zip(traj[0]["rollout_logprobs"], traj[0]["loss_mask"], strict=True) if m)


def test_session_abort_stops_the_generation_for_good(gateway: GatewayProc, router_url: str) -> None:
    client = openai_client(gateway)
    sid = "surplus-1"
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=LONG, temperature=1.0, seed=3, extra_body={"ignore_eos": True},
        extra_headers={"X-Session-Id": sid})))
    t.start()
    engine = _engine_url(router_url)
    _wait_for(engine, "num_running_reqs")
    time.sleep(0.2)
    r = httpx.post(f"{gateway.base_url}/sessions/{sid}/abort", timeout=30)
    assert r.status_code == 200 and r.json()["aborted"] == 1 and r.json()["engines"] == 1
    t.join(120)
    done = result["r"]
    assert 0 < done.usage.completion_tokens < LONG  # stopped, and not continued
    traj = httpx.get(f"{gateway.base_url}/sessions/{sid}/trajectory", timeout=10).json()
    assert sum(traj[0]["loss_mask"]) == done.usage.completion_tokens
    assert httpx.post(f"{gateway.base_url}/sessions/no-such-session/abort", timeout=10).status_code == 404


def test_session_abort_reaches_every_sample_of_n(gateway: GatewayProc, router_url: str) -> None:
    """n = 3 runs as three engine requests of n = 1 ({rid}_0.._2: SGLang names the samples of one n > 1
    request with fresh uuids, which no abort by rid reaches): the session abort stops all three."""
    client = openai_client(gateway)
    sid = "surplus-n3"
    engine = _engine_url(router_url)
    before = _counter(gateway, "slime_partial_rollout_continuations_total")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=LONG, n=3, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": sid})))
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _load(engine)["num_running_reqs"] < 3:
        time.sleep(0.01)
    time.sleep(0.2)
    r = httpx.post(f"{gateway.base_url}/sessions/{sid}/abort", timeout=30)
    assert r.status_code == 200 and r.json()["aborted"] == 3  # one engine request per sample
    t.join(120)
    done = result["r"]
    assert len(done.choices) == 3 and done.usage.completion_tokens < 3 * LONG  # stopped, none continued
    assert all(c.finish_reason != "length" for c in done.choices)
    assert _counter(gateway, "slime_partial_rollout_continuations_total") == before
    trajs = httpx.get(f"{gateway.base_url}/sessions/{sid}/trajectory", timeout=10).json()
    assert len(trajs) == 3 and all(t["turns"][-1]["finish_reason"] == "abort" for t in trajs)
    assert sum(sum(t["loss_mask"]) for t in trajs) == done.usage.completion_tokens


def test_session_abort_reaches_a_continuation(gateway: GatewayProc, router_url: str) -> None:
    """The engine aborts a generation (a weight update's pause), the gateway sends the continuation
    ({rid}-cont0) which waits on the paused engine; the session abort now must stop that one."""
    client = openai_client(gateway)
    sid = "surplus-cont"
    engine = _engine_url(router_url)
    before = _counter(gateway, "slime_partial_rollout_continuations_total")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=LONG, temperature=1.0, seed=9,
        extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": sid})))
    t.start()
    _wait_for(engine, "num_running_reqs")
    httpx.post(f"{engine}/pause_generation", json={"mode": "abort"}, timeout=10).raise_for_status()
    try:
        _wait_for(engine, "num_waiting_reqs")  # the continuation is queued on the paused engine
        r = httpx.post(f"{gateway.base_url}/sessions/{sid}/abort", timeout=30)
        assert r.status_code == 200 and r.json()["aborted"] == 2  # the request and its continuation
    finally:
        httpx.post(f"{engine}/continue_generation", json={}, timeout=10).raise_for_status()
    t.join(120)
    done = result["r"]
    assert done.choices[0].finish_reason != "length" and done.usage.completion_tokens < LONG
    assert _counter(gateway, "slime_partial_rollout_continuations_total") == before + 1  # and no second one
    traj = httpx.get(f"{gateway.base_url}/sessions/{sid}/trajectory", timeout=10).json()
    assert sum(traj[0]["loss_mask"]) == done.usage.completion_tokens
    assert traj[0]["turns"][-1]["finish_reason"] == "abort"


@pytest.mark.parametrize("n", [1, 3])
def test_session_abort_reaches_a_streamed_turn(gateway: GatewayProc, router_url: str, n: int) -> None:
    """A streamed turn's samples are engine streams registered with the session (n = 3: three of them, merged):
    the session abort ends the stream early, nothing is continued, and the turn is recorded with what streamed."""
    client = openai_client(gateway)
    sid = f"surplus-stream-{n}"
    engine = _engine_url(router_url)
    before = _counter(gateway, "slime_partial_rollout_continuations_total")
    chunks: list = []

    def consume() -> None:
        stream = client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=LONG, n=n, temperature=1.0, seed=7, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"X-Session-Id": sid})
        chunks.extend(stream)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _load(engine)["num_running_reqs"] < n:
        time.sleep(0.01)
    time.sleep(0.2)
    r = httpx.post(f"{gateway.base_url}/sessions/{sid}/abort", timeout=30)
    assert r.status_code == 200 and r.json()["aborted"] == n  # one engine stream per sample, all registered
    t.join(120)
    assert not t.is_alive()
    usage = chunks[-1].usage
    assert 0 < usage.completion_tokens < n * LONG  # stopped early
    finish = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert sorted(finish) == list(range(n)) and "length" not in finish.values()
    assert _counter(gateway, "slime_partial_rollout_continuations_total") == before  # not continued
    streamed = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == 0)
    traj = httpx.get(f"{gateway.base_url}/sessions/{sid}/trajectory", timeout=10).json()
    assert sum(sum(row["loss_mask"]) for row in traj) == usage.completion_tokens
    assert streamed  # the client got the text generated before the abort


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_answer_the_engine_aborts_goes_on_as_if_uninterrupted(gateway: GatewayProc, router_url: str,
                                                                         n: int) -> None:
    """An engine-side abort mid-stream (a weight update in ``abort`` mode) does not end the client's stream: each
    sample goes on from the tokens it streamed, and the streamed text equals the uninterrupted greedy answer; the
    turn is recorded whole (every token with its logprob)."""
    client = openai_client(gateway)
    sid = f"partial-stream-{n}"
    kw = dict(model=MODEL, messages=PROMPT, max_tokens=CONTINUED, temperature=0, extra_body={"ignore_eos": True})
    reference = client.chat.completions.create(**kw).choices[0].message.content
    engine = _engine_url(router_url)
    before = _counter(gateway, "slime_partial_rollout_continuations_total")
    stream = iter(client.chat.completions.create(**kw, n=n, stream=True, stream_options={"include_usage": True},
                                                 extra_headers={"X-Session-Id": sid}))
    chunks = [next(stream)]
    while not any(c.delta.content for c in chunks[-1].choices):  # the answer has begun streaming
        chunks.append(next(stream))
    httpx.post(f"{engine}/pause_generation", json={"mode": "abort"}, timeout=10).raise_for_status()
    time.sleep(0.3)
    httpx.post(f"{engine}/continue_generation", json={}, timeout=10).raise_for_status()
    chunks.extend(stream)
    streamed = ["".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == i)
                for i in range(n)]
    finish = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert streamed == [reference] * n  # greedy: every sample is the uninterrupted answer, character for character
    assert finish == dict.fromkeys(range(n), "length") and chunks[-1].usage.completion_tokens == CONTINUED * n
    assert _counter(gateway, "slime_partial_rollout_continuations_total") >= before + 1  # it was aborted, and went on
    traj = httpx.get(f"{gateway.base_url}/sessions/{sid}/trajectory", timeout=10).json()
    assert sorted(sum(row["loss_mask"]) for row in traj) == [CONTINUED] * n
    assert all(lp <= 0 for row in traj for lp, m in zip(row["rollout_logprobs"], row["loss_mask"], strict=True) if m)
