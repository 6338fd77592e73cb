"""Access control (issue 9): admin / agent / session keys, hashed at rest, CORS off, request limits.

Real gateway processes over the real router and a CPU engine; the `openai` SDK and plain HTTP as
clients. Keys are minted both offline (``slime-server keys create``) and over ``/admin/keys``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    openai_client,
    running_gateway,
)

pytestmark = pytest.mark.slow
ADMIN = "sk-test-admin"
SHARED = "sk-test-shared-agent"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("access")


@pytest.fixture(scope="module")
def offline_admin_key(work: Path) -> str:
    """An admin key minted with the CLI before the server starts (the bootstrap path)."""
    out = subprocess.run([sys.executable, "-m", "slime_server.cli", "keys", "create", "--role", "admin",
                          "--name", "ops", "--db-path", str(work / "traj.db")],
                         capture_output=True, text=True, check=True, timeout=60)
    minted = json.loads(out.stdout.strip().splitlines()[-1])
    assert minted["role"] == "admin" and minted["key"].startswith("sk-slime-")
    return minted["key"]


@pytest.fixture(scope="module")
def gateway(router_url: str, tiny_model_path: Path, work: Path,
            offline_admin_key: str) -> Iterator[GatewayProc]:
    with running_gateway(router_url, tiny_model_path, work / "traj.db", work / "gateway.log",
                         "--api-key", SHARED, "--admin-api-key", ADMIN) as gw:
        yield gw


def call(gw: GatewayProc, method: str, path: str, key: str | None, body: object = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{gw.url}{path}", json=body, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err


def mint(gw: GatewayProc, admin_key: str, role: str = "agent", name: str = "") -> str:
    r = call(gw, "POST", "/admin/keys", admin_key, {"role": role, "name": name})
    assert r.status_code == 200, r.text
    return r.json()["key"]


def chat(gw: GatewayProc, key: str, session_id: str | None = None) -> openai.types.chat.ChatCompletion:
    headers = {"X-Session-Id": session_id} if session_id else {}
    return openai_client(gw, api_key=key).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, temperature=0, extra_headers=headers)


def test_keys_are_hashed_at_rest(gateway: GatewayProc, offline_admin_key: str, work: Path) -> None:
    agent = mint(gateway, offline_admin_key, name="fleet-a")
    listed = call(gateway, "GET", "/admin/keys", ADMIN).json()["data"]
    assert {k["name"] for k in listed} >= {"ops", "fleet-a"}
    assert all("key" not in k and "key_hash" not in k for k in listed)
    chat(gateway, agent)  # the key works ...
    secrets = [offline_admin_key.split(".", 1)[1], agent.split(".", 1)[1]]
    raw = b"".join(p.read_bytes() for p in work.glob("traj.db*"))
    assert raw and not any(s.encode() in raw for s in secrets)  # ... but no secret is on disk


def test_agent_keys_reach_only_their_own_sessions(gateway: GatewayProc, offline_admin_key: str) -> None:
    a, b = mint(gateway, offline_admin_key, name="a"), mint(gateway, offline_admin_key, name="b")
    sa = call(gateway, "POST", "/v1/sessions", a, {}).json()["id"]
    ra = chat(gateway, a, sa)
    assert call(gateway, "POST", f"/v1/sessions/{sa}/reward", a, {"reward": 1.0}).status_code == 200
    assert call(gateway, "GET", f"/v1/sessions/{sa}", a).json()["num_turns"] == 1

    # b can neither read, reward, close, abort, extend nor give feedback on a's session
    for method, path, body in (("GET", f"/v1/sessions/{sa}", None), ("GET", f"/v1/sessions/{sa}/trajectory", None),
                               ("POST", f"/v1/sessions/{sa}/reward", {"reward": 0.0}),
                               ("POST", f"/v1/sessions/{sa}/close", {}), ("POST", f"/v1/sessions/{sa}/abort", {}),
                               ("POST", f"/v1/responses/{ra.id}/feedback", {"thumb": "down"})):
        assert_error(call(gateway, method, path, b, body), 403, "session_forbidden")
    with pytest.raises(openai.PermissionDeniedError):
        chat(gateway, b, sa)
    # a session b names first (by header) is b's, and the shared key's sessions are its own too
    chat(gateway, b, "sess-named-by-b")
    assert_error(call(gateway, "POST", "/v1/sessions/sess-named-by-b/reward", a, {"reward": 1}), 403)
    assert call(gateway, "POST", "/v1/sessions/sess-named-by-b/reward", b, {"reward": 1}).status_code == 200
    assert_error(call(gateway, "GET", f"/v1/sessions/{sa}", SHARED), 403)
    # one-shot calls (no session named) belong to their caller as well
    one_shot = chat(gateway, b)
    assert_error(call(gateway, "POST", f"/v1/responses/{one_shot.id}/feedback", a, {"thumb": "up"}), 403)
    assert call(gateway, "POST", f"/v1/responses/{one_shot.id}/feedback", b, {"thumb": "up"}).status_code == 200
    # the admin reaches everything; a's stored reward is intact after b's refused attempts
    view = call(gateway, "GET", f"/v1/sessions/{sa}/trajectory", ADMIN).json()
    assert [t["reward"] for t in view] == [1.0]


def test_a_front_end_names_its_users_and_nobody_else_can(gateway: GatewayProc, offline_admin_key: str) -> None:
    """Issue 43: a frontend key says, per call, which of its users it acts for (``X-Slime-User``): each user's
    sessions are recorded as theirs and reached only as them; an agent key, the shared key or the admin naming a
    user is a 403 in the API's own error shape, and an agent key's own calls are that key's user."""
    front, agent = mint(gateway, offline_admin_key, "frontend", "web"), mint(gateway, offline_admin_key)
    front_id, agent_id = (k.removeprefix("sk-slime-").split(".")[0] for k in (front, agent))

    def as_user(key: str, user: str | None, method: str, path: str, body: object = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}", **({"X-Slime-User": user} if user else {})}
        return httpx.request(method, f"{gateway.url}{path}", json=body, headers=headers, timeout=60)

    alice = as_user(front, "alice", "POST", "/v1/sessions", {}).json()["id"]
    r = as_user(front, "alice", "POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 2})
    assert r.status_code == 200, r.text
    openai_client(gateway, api_key=front).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, extra_headers={"X-Session-Id": alice, "X-Slime-User": "alice"})
    view = as_user(front, "alice", "GET", f"/v1/sessions/{alice}").json()
    assert view["user"] == f"key:{front_id}/alice" and view["num_turns"] == 1
    # bob (same front end) and the front end acting for nobody cannot reach alice's session
    assert_error(as_user(front, "bob", "GET", f"/v1/sessions/{alice}"), 403, "session_forbidden")
    assert_error(as_user(front, None, "POST", f"/v1/sessions/{alice}/reward", {"reward": 1.0}), 403)
    assert as_user(front, "alice", "POST", f"/v1/sessions/{alice}/reward", {"reward": 1.0}).status_code == 200
    # nobody else may name a user: OpenAI and Anthropic shapes
    for key in (agent, SHARED, ADMIN):
        assert_error(as_user(key, "alice", "POST", "/v1/chat/completions",
                             {"model": MODEL, "messages": USER, "max_tokens": 2}), 403, "user_header_forbidden")
    r = as_user(agent, "alice", "POST", "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": USER})
    assert r.status_code == 403 and r.json()["type"] == "error" and "X-Slime-User" in r.json()["error"]["message"]
    assert_error(as_user(front, "no spaces", "POST", "/v1/sessions", {}), 400, "invalid_value")
    mine = call(gateway, "POST", "/v1/sessions", agent, {}).json()["id"]
    assert call(gateway, "GET", f"/v1/sessions/{mine}", agent).json()["user"] == f"key:{agent_id}"
    assert call(gateway, "GET", f"/v1/sessions/{alice}", ADMIN).json()["user"] == f"key:{front_id}/alice"


def test_admin_routes_refuse_agent_and_session_keys(gateway: GatewayProc, offline_admin_key: str) -> None:
    agent = mint(gateway, offline_admin_key)
    created = call(gateway, "POST", "/v1/sessions", agent, {"with_key": True}).json()
    session_key = created["api_key"]
    other = call(gateway, "POST", "/v1/sessions", agent, {}).json()["id"]
    for key in (agent, SHARED, session_key):
        for method, path, body in (("GET", "/jobs", None), ("POST", "/jobs", {}), ("GET", "/admin/keys", None),
                                   ("POST", "/admin/keys", {"role": "admin"}), ("GET", "/admin/export", None)):
            assert_error(call(gateway, method, path, key, body), 403, "admin_required")
    for path in ("/jobs", "/admin/keys", "/admin/export"):
        assert_error(call(gateway, "GET", path, None), 401)
        assert_error(call(gateway, "GET", path, "sk-slime-0000.forged"), 401)
    # the session key reaches its session only, and cannot mint sessions
    assert call(gateway, "GET", f"/v1/sessions/{created['id']}", session_key).status_code == 200
    assert_error(call(gateway, "GET", f"/v1/sessions/{other}", session_key), 403, "session_forbidden")
    assert_error(call(gateway, "POST", "/v1/sessions", session_key, {}), 403)
    # admin keys: the configured one, the one minted offline, and one minted over REST
    rest_admin = mint(gateway, ADMIN, role="admin")
    for key in (ADMIN, offline_admin_key, rest_admin):
        assert call(gateway, "GET", "/admin/keys", key).status_code == 200
        assert call(gateway, "GET", f"/v1/sessions/{other}", key).status_code == 200


def test_revoked_keys_stop_working(gateway: GatewayProc, offline_admin_key: str) -> None:
    agent = mint(gateway, offline_admin_key, name="short-lived")
    chat(gateway, agent)
    key_id = agent[len("sk-slime-"):].split(".")[0]
    revoked = call(gateway, "POST", f"/admin/keys/{key_id}/revoke", ADMIN).json()
    assert revoked["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError):
        chat(gateway, agent)
    assert_error(call(gateway, "POST", "/admin/keys/nope/revoke", ADMIN), 404, "key_not_found")


def test_export_over_http(gateway: GatewayProc, offline_admin_key: str) -> None:
    agent = mint(gateway, offline_admin_key)
    sid = call(gateway, "POST", "/v1/sessions", agent, {}).json()["id"]
    chat(gateway, agent, sid)
    call(gateway, "POST", f"/v1/sessions/{sid}/reward", agent, {"reward": 0.5})
    call(gateway, "POST", f"/v1/sessions/{sid}/close", agent, {})
    r = call(gateway, "GET", "/admin/export?rewarded_only=true", ADMIN)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    samples = [json.loads(line) for line in r.text.splitlines()]
    mine = [s for s in samples if s["session_id"] == sid]
    assert len(mine) == 1 and mine[0]["reward"] == 0.5 and sum(mine[0]["loss_mask"]) > 0
    assert all(s["reward"] is not None for s in samples)
    assert len(call(gateway, "GET", "/admin/export?status=all&limit=1", ADMIN).text.splitlines()) == 1


@pytest.fixture(scope="module")
def limited(router_url: str, tiny_model_path: Path, work: Path) -> Iterator[GatewayProc]:
    settings = {"cors_origins": ["http://allowed.example"], "max_prompt_tokens": 40, "max_output_tokens": 4}
    with running_gateway(router_url, tiny_model_path, work / "limited.db", work / "limited.log",
                         "--log-level", "info", "--log-format", "json", settings=settings) as gw:
        yield gw


def _preflight(gw: GatewayProc, origin: str) -> httpx.Response:
    return httpx.options(f"{gw.base_url}/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_is_off_unless_configured(gateway: GatewayProc, limited: GatewayProc) -> None:
    assert "access-control-allow-origin" not in _preflight(gateway, "http://allowed.example").headers
    r = call(gateway, "GET", "/v1/models", SHARED)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert _preflight(limited, "http://allowed.example").headers["access-control-allow-origin"] == \
        "http://allowed.example"
    assert "access-control-allow-origin" not in _preflight(limited, "http://evil.example").headers


def test_token_limits(limited: GatewayProc) -> None:
    client = openai_client(limited)
    long = [{"role": "user", "content": " one two three four" * 20}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=2)
    assert e.value.code == "prompt_too_long"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
    assert e.value.code == "max_tokens_too_large"
    r = client.chat.completions.create(model=MODEL, messages=USER, temperature=1.0, seed=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4  # the server's cap is also the default max_tokens


def test_structured_access_log(limited: GatewayProc) -> None:
    client = openai_client(limited)
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                   extra_headers={"X-Session-Id": "sess-logged", "X-Request-Id": "req-42"})
    deadline = time.monotonic() + 10  # the line is written once the response is sent: the client may be first
    while True:
        lines = [json.loads(line) for line in limited.log_path.read_text().splitlines() if line.startswith("{")]
        hits = [x for x in lines if x.get("path") == "/v1/chat/completions" and x.get("request_id") == "req-42"]
        if hits or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(hits) == 1, lines[-5:]
    hit = hits[0]
    assert hit["status"] == 200 and hit["session_id"] == "sess-logged" and hit["method"] == "POST"
    assert hit["level"] == "info" and hit["logger"] == "slime_server.access" and hit["duration_ms"] > 0


def test_prometheus_request_metrics(limited: GatewayProc) -> None:
    openai_client(limited).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    httpx.get(f"{limited.base_url}/sessions/sess-nope")
    text = httpx.get(f"{limited.url}/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("slime_") and not line.startswith("#")}
    assert samples['slime_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}'] >= 1
    assert samples['slime_http_requests_total{method="GET",route="/v1/sessions/{session_id}",status="404"}'] >= 1
    assert samples['slime_http_request_duration_seconds_count{route="/v1/chat/completions"}'] >= 1
    assert samples['slime_recorded_tokens_total{kind="completion"}'] >= 1
