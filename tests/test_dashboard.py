"""The dashboard (``/dashboard``): its admin JSON API, and the page itself in headless chromium.

The browser test runs a real ``serve`` stack (one CPU engine behind the sgl-router, the gateway, the
job manager with a Megatron-core rank), trains a short job on openai-SDK traffic, and checks what an
operator sees: jobs, curves with data points, engines, a session's token view, and that the pause /
resume / cancel buttons move the job. The page reports what it drew in ``window.dashboard``.
Chromium is the Debian package (``.ci/run`` installs it); without it the browser test skips.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from slime_server.utils.net import find_free_port
from tests._jobs_helpers import ADMIN, AGENT, create_job, drive, job, running_stack, wait_event, wait_job
from tests._json_http import JsonHandler

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and os.access(p, os.X_OK)), None)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ---------------------------------------------------------------- the JSON API, no browser, no engines
class _Tokenizer:
    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [f"<{i[0]}>" for i in ids]


class _Renderer:
    tokenizer = _Tokenizer()


def add_tool_episode(store: Any, sid: str) -> None:
    """A recorded two-turn episode: the first turn calls a tool, the second answers after its result."""
    from slime_server.buffer.schema import ToolCallRef, Trajectory, Turn
    from slime_server.buffer.store import ResponseRef, TurnWrite

    mask = [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    turns = [Turn(response_id="r-1", prompt_start=0, output_start=4, output_end=7, finish_reason="stop",
                  tool_calls=[ToolCallRef(name="add", arguments='{"a": 1, "b": 2}')]),
             Turn(response_id="r-2", prompt_start=7, output_start=10, output_end=12, finish_reason="stop")]
    t = Trajectory(session_id=sid, group_id=sid, tokens=list(range(1, 13)), loss_mask=mask,
                   rollout_logprobs=[-0.5 * m for m in mask], weight_versions=[0] * len(mask), turns=turns,
                   turn_rewards=[None, None])
    store.create_session(sid)
    store.write_turn(TurnWrite(session_id=sid, trajectories=[t], responses=[
        ResponseRef(response_id=f"r-{i}", choice=0, trajectory_id=t.id) for i in (1, 2)]))
    store.set_reward(sid, reward=1.0)


@pytest.fixture
def bare_app(tmp_path: Path) -> Iterator[Any]:
    """The gateway app with no engines (nothing listens on its router port) and no trainer."""
    from slime_server.api.app import create_app
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.config import GatewaySettings

    store = SQLiteTrajectoryStore(tmp_path / "db.sqlite")
    add_tool_episode(store, "tool-ep")
    for i in range(3):
        store.create_session(f"s-{i}")
    settings = GatewaySettings(api_key=AGENT, admin_api_key=ADMIN, db_path=str(tmp_path / "db.sqlite"),
                               port=find_free_port())
    yield create_app(router_url=f"http://127.0.0.1:{find_free_port()}", renderer=_Renderer(), sessions=None,
                     store=store, settings=settings, model_name="tiny")
    store.close()


@pytest.fixture
def api_app(bare_app: Any) -> Iterator[TestClient]:
    with TestClient(bare_app) as client:
        yield client


class _SGLang0523Engine(JsonHandler):
    """Stands in for a router with one SGLang 0.5.23 engine behind it (both on this one port): the engine serves
    ``/v1/loads`` in SGLang's shape (two DP ranks, more fields than we read) and no ``/get_load``."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        host = f"http://127.0.0.1:{self.server.server_address[1]}"
        path = self.path.split("?")[0]
        if path == "/workers":
            self.answer(200, {"workers": [{"url": host, "is_healthy": True, "load": 5}]})
        elif path == "/health":
            self.answer(200, {})
        elif path == "/model_info":
            self.answer(200, {"model_path": "m", "weight_version": "7"})
        elif path == "/v1/loads":
            rank = {"timestamp": 1.0, "num_used_tokens": 10, "num_total_tokens": 20, "token_usage": 0.5,
                    "gen_throughput": 3.0, "memory": {"weight_gb": 1.0}}
            self.answer(200, {"timestamp": "2026-11-27T10:00:00+00:00", "version": "0.5.23",
                              "accelerator": "NVIDIA H200", "num_accelerators": 1,
                              "loads": [{**rank, "dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1},
                                        {**rank, "dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0}]})
        else:
            self.answer(404, {"detail": "Not Found"})


def test_dashboard_reads_load_from_sglang_0_5_23s_route(tmp_path: Path) -> None:
    """Issue 41: SGLang 0.5.23 serves an engine's load at ``/v1/loads`` (no ``/get_load``): the dashboard shows
    it, summed over the engine's DP ranks."""
    import threading
    from http.server import ThreadingHTTPServer

    from slime_server.api.app import create_app
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.config import GatewaySettings

    http = ThreadingHTTPServer(("127.0.0.1", 0), _SGLang0523Engine)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    store = SQLiteTrajectoryStore(tmp_path / "db.sqlite")
    settings = GatewaySettings(api_key=AGENT, admin_api_key=ADMIN, db_path=str(tmp_path / "db.sqlite"),
                               port=find_free_port())
    try:
        app = create_app(router_url=url, renderer=_Renderer(), sessions=None, store=store, settings=settings,
                         model_name="tiny")
        with TestClient(app) as client:
            view = client.get("/dashboard/api/engines", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    finally:
        http.shutdown()
        store.close()
    assert view["router_reachable"] is True
    [engine] = view["engines"]
    assert engine["url"] == url and engine["healthy"] and engine["error"] is None
    assert (engine["running_reqs"], engine["waiting_reqs"], engine["weight_version"]) == (5, 1, "7")


def test_dashboard_api_needs_the_admin_key(api_app: TestClient) -> None:
    page = api_app.get("/dashboard")  # the page and its files carry no data: no key needed
    assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
    for name in ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert api_app.get(f"/dashboard/static/{name}").status_code == 200, name
    for bad in ("..%2Fdashboard.py", ".hidden", "nope.js"):
        assert api_app.get(f"/dashboard/static/{bad}").status_code == 404
    calls = [("GET", "/dashboard/api/engines", None), ("GET", "/dashboard/api/sessions", None),
             ("POST", "/dashboard/api/detokenize", {"ids": [1, 2]}), ("GET", "/dashboard/api/sessions/s-1/tools", None)]
    for method, path, body in calls:
        r = api_app.request(method, path, json=body)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]  # OpenAI error format
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key" and err["message"]
        r = api_app.request(method, path, json=body, headers={"Authorization": f"Bearer {AGENT}"})
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["type"] == "permission_error"
        r = api_app.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, (path, r.text)


def test_dashboard_api_answers_the_admin(api_app: TestClient) -> None:
    h = {"Authorization": f"Bearer {ADMIN}"}
    engines = api_app.get("/dashboard/api/engines", headers=h).json()
    assert engines["router_reachable"] is False and engines["router_error"] and engines["engines"] == []
    sessions = api_app.get("/dashboard/api/sessions?limit=2", headers=h).json()["data"]
    assert [s["id"] for s in sessions] == ["s-2", "s-1"]  # newest first
    assert sessions[0]["num_trajectories"] == 0 and sessions[0]["reward"] is None
    tool_ep = api_app.get("/dashboard/api/sessions?limit=10", headers=h).json()["data"][-1]
    assert (tool_ep["id"], tool_ep["num_trajectories"], tool_ep["num_tokens"], tool_ep["reward"]) == ("tool-ep", 1, 12, 1.0)
    tools = api_app.get("/dashboard/api/sessions/tool-ep/tools", headers=h).json()
    assert [[c["name"] for c in turn["tool_calls"]] for turn in tools[0]["turns"]] == [["add"], []]
    assert api_app.get("/dashboard/api/sessions/nope/tools", headers=h).status_code == 404
    assert api_app.get("/dashboard/api/sessions?limit=0", headers=h).status_code == 400
    assert api_app.post("/dashboard/api/detokenize", headers=h, json={"ids": [7, 8]}).json() == {"pieces": ["<7>", "<8>"]}


# ---------------------------------------------------------------- the page in chromium over a real stack
@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("chromium not found (Debian: apt-get install chromium; .ci/run installs it)")
    with running_stack(tiny_model_path, tmp_path_factory.mktemp("dashboard")) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("chromium not found (Debian: apt-get install chromium; .ci/run installs it)")
    # playwright is in the dev extra: its absence is a failure, not a skip
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def test_page_asks_for_the_key_and_survives_a_bare_server(bare_app: Any, browser: Any) -> None:
    """No key: the page says what is missing. With the key typed in: no trainer, no router, still a page."""
    from slime_server.server.gateway_thread import GatewayThread

    port = bare_app.state.gw.settings.port
    gateway = GatewayThread(bare_app, "127.0.0.1", port).start()
    page = browser.new_page()
    try:
        page.goto(f"http://127.0.0.1:{port}/dashboard")
        page.wait_for_selector("#status.error")
        assert "401" in page.inner_text("#status") and "admin key" in page.inner_text("#status")
        page.fill("#key", ADMIN)
        page.click("#key-form button")
        page.wait_for_function("() => document.querySelector('#status').textContent.startsWith('updated')")
        assert "without a trainer" in page.inner_text("#jobs-note")
        assert "unreachable" in page.inner_text("#router")
        assert page.locator("#sessions tbody tr").count() == 4
        assert page.evaluate("() => localStorage.getItem('slime-server.dashboard.key')") == ADMIN
        # the token view marks the tool call, the tool result that came back, and the generated tokens
        page.click('#sessions tbody tr[data-session="tool-ep"]')
        page.wait_for_function("() => window.dashboard.tokenView && window.dashboard.tokenView.sessionId === 'tool-ep'")
        assert page.evaluate("() => window.dashboard.tokenView") == {
            "sessionId": "tool-ep", "trajectories": 1, "tokens": 12, "generated": 5}
        assert page.locator("#token-view .tok.gen").all_inner_texts() == ["<5>", "<6>", "<7>", "<11>", "<12>"]
        assert page.locator("#token-view .marker").all_inner_texts() == [
            "turn 0 · prompt", "turn 0 · generated · tool call: add (stop)", "turn 1 · tool result",
            "turn 1 · generated (stop)"]
        assert page.locator("#token-view .marker.tool").count() == 2
        assert page.inner_text("#token-view .reward") == "1"
    finally:
        page.close()
        gateway.stop()


def two_turn_session(server: Any) -> str:
    """A session of two chat turns (the second extends the first) with a reward."""
    sid = f"dash-{uuid.uuid4().hex[:10]}"
    client = OpenAI(base_url=server.base_url, api_key=AGENT, default_headers={"X-Session-Id": sid}, max_retries=0)
    model = Path(server.deployment.model_path).name
    messages: list[Any] = [{"role": "user", "content": "Count to 3."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=1)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "And back."}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=2)
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {AGENT}"}) as c:
        c.post(f"/sessions/{sid}/reward", json={"reward": 0.75}).raise_for_status()
    return sid


def wait_status(server: Any, job_id: str, status: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while job(server, job_id)["status"] != status:
        assert time.monotonic() < deadline, f"job never became {status}: {job(server, job_id)}"
        time.sleep(0.2)


@pytest.mark.slow
def test_dashboard_in_chromium(server: Any, browser: Any) -> None:
    base = server.base_url.removesuffix("/v1")
    j = create_job(server, batch_size=2, max_staleness=None, checkpoint_interval=1000)
    jid = j["id"]

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{base}/dashboard?key={ADMIN}")
    assert page.title() == "slime-server dashboard"
    page.wait_for_function("() => window.dashboard && window.dashboard.jobs.length > 0", timeout=15_000)
    assert "key=" not in page.url  # the key went to localStorage, not the history
    page.wait_for_selector(f'#jobs tr[data-job="{jid}"]')

    wait_event(server, jid, "trainer_ready")
    drive(server, 6, concurrency=2)  # 3 steps of 2
    sid = two_turn_session(server)
    wait_job(server, jid, lambda x: x["step"] >= 3)

    # curves: every chart whose metric the job reports has all the steps (the page polls every 2 s)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        reported = set(c.get(f"/jobs/{jid}/metrics").json()[0]["metrics"])
        trajectory = c.get(f"/v1/sessions/{sid}/trajectory").json()
    page.wait_for_function("() => ['reward', 'loss', 'version'].every(k => window.dashboard.points[k] >= 3)",
                           timeout=20_000)
    points = page.evaluate("() => window.dashboard.points")
    for chart, key in [("reward", "reward_mean"), ("loss", "loss"), ("kl", "kl"), ("clip", "clip_fraction"),
                       ("staleness", "staleness_mean"), ("tokens_per_s", "tokens_per_s"), ("version", "policy_version")]:
        if key in reported:
            assert points[chart] >= 3, (chart, points)
            assert page.locator(f'#charts .chart[data-chart="{chart}"] canvas').count() == 1
    assert {"reward_mean", "loss", "staleness_mean", "tokens_per_s", "policy_version"} <= reported
    assert points["eval"] == 0 and page.locator('.chart[data-chart="eval"]').count() == 0  # no evals: no chart

    # engines: the router's one worker, probed directly
    page.wait_for_function("() => window.dashboard.engines && window.dashboard.engines.engines.length > 0")
    engines = page.evaluate("() => window.dashboard.engines")
    assert engines["router_reachable"] is True
    assert [e["url"] for e in engines["engines"]] == list(server.deployment.engine_urls)
    assert all(e["healthy"] and e["router_healthy"] and e["weight_version"] is not None for e in engines["engines"])
    assert page.locator('#engines tbody tr[data-healthy="true"]').count() == 1

    # a session's token view: every generated token highlighted, turn markers, the reward
    row = page.locator(f'#sessions tbody tr[data-session="{sid}"]')
    row.wait_for(timeout=10_000)
    row.click()
    page.wait_for_function(f"() => window.dashboard.tokenView && window.dashboard.tokenView.sessionId === '{sid}'")
    view = page.evaluate("() => window.dashboard.tokenView")
    assert view["tokens"] == sum(len(t["tokens"]) for t in trajectory)
    assert view["generated"] == sum(sum(t["loss_mask"]) for t in trajectory) > 0
    markers = page.locator("#token-view .marker").all_inner_texts()
    assert sum("generated" in m for m in markers) == sum(len(t["turns"]) for t in trajectory) == 2
    assert "0.75" in page.locator("#token-view .reward").first.inner_text()

    # controls: pause, resume, cancel (with its confirm dialog) move the job
    page.on("dialog", lambda d: d.accept())
    for action, status in (("pause", "paused"), ("resume", "running"), ("cancel", "cancelled")):
        button = page.locator(f'#jobs button[data-action="{action}"][data-job="{jid}"]')
        button.wait_for()
        page.wait_for_function(f"() => !document.querySelector('#jobs button[data-action=\"{action}\"]"
                               f"[data-job=\"{jid}\"]').disabled")
        button.click()
        wait_status(server, jid, status)
        page.wait_for_selector(f'#jobs tr[data-job="{jid}"][data-status="{status}"]', timeout=10_000)
    assert errors == [], errors
    page.close()
