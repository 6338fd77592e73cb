"""Schemathesis against the gateway's published OpenAPI spec (``/openapi.json``), every operation.

Why a live stack: bad input must be refused before it reaches the engine or the store, and good
input must really be served, so the fuzzed requests go over HTTP to the real gateway (uvicorn on a
real port, as ``slime-server serve`` runs it) in front of the real sgl-router and a CPU engine.

Checks per request: no 5xx (``not_a_server_error``), status codes, content types and bodies as the
spec declares them, and every 4xx body in OpenAI's error format. Jobs run against a real
``JobManager`` over the same SQLite file whose trainer factory refuses (no Megatron ranks here), so
``POST /jobs`` really validates, stores and launches a job, which then fails in its own thread;
no 503 ``no_trainer`` is excused anywhere. Generation is kept cheap by capping ``max_tokens`` and
``n`` in generated bodies just before they are sent (``cap_generation``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed

from slime_server.gateway.protocol import MAX_N as MAX_N_SPEC
from tests._gateway_helpers import MODEL, inprocess_gateway

# Fresh examples on every run, within the fixed budget of max_examples: the seed is drawn per run by
# conftest.py (printed in pytest's header as "fuzz seed"); SLIME_FUZZ_SEED=<seed> replays a run.
SEED = int(os.environ["SLIME_FUZZ_SEED"])
pytestmark = pytest.mark.slow

MAX_TOKENS = 4
MAX_N = 2
ERROR_FIELDS = {"message", "type", "param", "code"}


def _refuse_trainer(spec: Any) -> Any:
    raise RuntimeError("this test server has no trainer ranks")


@pytest.fixture(scope="module")
def live_url(router_url: str, tiny_model_path: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway with a JobManager attached (its trainer factory refuses), over the real router."""
    from slime_server.buffer.job_store import SQLiteJobStore
    from slime_server.jobs.manager import JobManager

    d = tmp_path_factory.mktemp("fuzz")
    with inprocess_gateway(router_url, tiny_model_path, d / "traj.db") as (url, app):
        gw = app.state.gw
        gw.jobs = JobManager(gw.store, SQLiteJobStore(gw.settings.db_path), _refuse_trainer, list, d / "jobs",
                             served_model=gw.model_name)
        LIVE["app"] = app
        yield url
        gw.jobs.shutdown(timeout=10)


LIVE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def live_app(live_url: str) -> Any:
    return LIVE["app"]


def cap_generation(case: Any) -> None:
    """Make generation reach the engine and stay cheap; a capped value is as valid as the original."""
    body = case.body
    if case.path not in GENERATING or not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL  # else nearly every call is a 404 model_not_found (tested in test_gateway_errors)
    keys = GENERATING[case.path]
    for key in keys:
        if _int(body.get(key)) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if keys and not any(k in body for k in keys) and case.path != "/v1/messages":  # there it is required
        body[keys[0]] = MAX_TOKENS  # the default is "what the context leaves"
    if _int(body.get("n")) and MAX_N < body["n"] <= MAX_N_SPEC:  # above the spec's limit it must stay a 400
        body["n"] = MAX_N


# generating routes -> their output-token limits (capped); count_tokens only gets the served model's name
GENERATING = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"), "/v1/completions": ("max_tokens",),
              "/v1/responses": ("max_output_tokens",), "/v1/messages": ("max_tokens",),
              "/v1/messages/count_tokens": ()}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def openai_error_format(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx answer is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI SDKs read it), or under
    /v1/messages Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (Anthropic SDKs read that)."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        body = json.loads(response.content)
    except ValueError as e:
        raise AssertionError(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from e
    if case.path.startswith("/v1/messages"):
        assert isinstance(body, dict) and body.get("type") == "error", f"not an Anthropic error body: {body}"
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        return True
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and set(err) == ERROR_FIELDS, f"not an OpenAI error body: {body}"
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
    # The gateway must refuse what the engine would: every engine 4xx counts toward sgl-router's circuit
    # breaker, and ten of them shut the engine off for everybody (seen: top_p 5e-324, seed -1, top_k 2**40).
    assert err["code"] != "engine_rejected", f"a request the engine refuses got past the gateway: {body}"
    return True


def published_spec() -> dict[str, Any]:
    """The gateway's OpenAPI document, built from the app itself (the live server must publish the same)."""
    from slime_server.api.app import create_app

    return create_app(router_url="http://127.0.0.1:9", renderer=None, sessions=None, store=None,
                      model_name=MODEL).openapi()


# Built at collection time so pytest shows one test per operation; `schemathesis.pytest.from_fixture`
# (the lazy loader) does not run under pytest 9 (it sets `Function._nodeid`).
schema = schemathesis.openapi.from_dict(published_spec())


def test_each_responses_item_and_part_matches_one_branch_of_its_union() -> None:
    """The Responses input's item, content-part and tool unions are published as oneOf, each with a catch-all for
    the types refused by name (OtherItem, UnsupportedPart, HostedTool). A catch-all that also matched the known types made every
    function_call_output item schema-invalid (two branches), so a fuzz case built on one was "invalid data
    accepted" (CI57). Each kind of item and part the API takes must match exactly one branch."""
    import jsonschema

    spec = published_spec()
    request = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = request["$ref"].split("/")[-1]
    items = spec["components"]["schemas"][name]["properties"]["input"]["anyOf"][1]["items"]
    validator = jsonschema.Draft202012Validator({**items, "components": spec["components"]})
    part = {"type": "input_text", "text": "hi"}
    for item in ({"role": "user", "content": "hi"}, {"type": "message", "role": "user", "content": [part]},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                 {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
                 {"type": "function_call_output", "call_id": "c1", "output": "42", "id": "fco_1"},
                 {"type": "reasoning", "summary": [], "id": "rs_1"}, {"type": "item_reference", "id": "x"},
                 {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}):
        assert validator.is_valid(item), (item, [e.message for e in validator.iter_errors(item)])
    tools = spec["components"]["schemas"][name]["properties"]["tools"]
    tools = next(branch for branch in tools.get("anyOf", [tools]) if branch.get("type") == "array")["items"]
    validator = jsonschema.Draft202012Validator({**tools, "components": spec["components"]})
    for tool in ({"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"},
                 {"type": "reasoning"}):
        assert validator.is_valid(tool), (tool, [e.message for e in validator.iter_errors(tool)])


def test_the_live_server_publishes_the_fuzzed_spec(live_url: str) -> None:
    import httpx

    assert httpx.get(f"{live_url}/openapi.json", timeout=30).json() == published_spec()


# Operator routes parse JSON in pydantic's lax mode ("8" -> 8, false -> 0.0 for a float): harmless for an
# admin's own job specs and keys, so "schema-violating data must be refused" is checked on /v1 only, whose
# models are strict like OpenAI's. Not checked anywhere: "schema-valid data must be accepted", because the
# gateway rightly answers 400 to requests that are well-typed but meaningless (a conversation the chat
# template cannot render, a prompt over the context, tool_choice naming no tool, "give thumb or score").
OPERATOR_PREFIXES = ("/jobs", "/admin", "/dashboard")
STATUSES: Counter[tuple[str, str, int]] = Counter()
LIVE_STATUSES: Counter[tuple[str, str, int]] = Counter()  # job routes called on a running or paused job


@hypothesis_seed(SEED)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@schema.parametrize()
def test_every_route_against_the_spec(case: Any, live_url: str) -> None:
    call_and_check(case, live_url)


def call_and_check(case: Any, live_url: str, statuses: Counter[tuple[str, str, int]] | None = None) -> None:
    from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

    cap_generation(case)
    excluded = [positive_data_acceptance]
    if case.path.startswith(OPERATOR_PREFIXES):
        excluded.append(negative_data_rejection)
    response = case.call(base_url=live_url, timeout=120)
    (STATUSES if statuses is None else statuses)[(case.method, case.path, response.status_code)] += 1
    case.validate_response(response, additional_checks=[openai_error_format], excluded_checks=excluded,
                           transport_kwargs={"base_url": live_url, "timeout": 120})


@pytest.fixture(scope="module")
def known_ids(live_url: str) -> dict[str, str]:
    """Ids of objects that exist: a session with two recorded turns and a reward, a job, an API key."""
    import httpx

    with httpx.Client(base_url=live_url, timeout=120) as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                          json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS})
            assert r.status_code == 200, r.text
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        assert http.post(f"/v1/sessions/{session}/reward", json={"reward": 1.0, "final": False}).status_code == 200
        jobs = http.get("/jobs").json()["data"]  # the fuzz above made some (each failed at once: no trainer)
        job = jobs[0]["id"] if jobs else http.post("/jobs", json={"name": "fuzz"}).json()["id"]
        stored = http.post("/v1/responses", headers={"X-Session-Id": session},
                           json={"model": MODEL, "input": "hi", "max_output_tokens": MAX_TOKENS})
        assert stored.status_code == 200, stored.text
        ids = {"session_id": session, "response_id": stored.json()["id"], "job_id": job, "model_id": MODEL}
        key = http.post("/admin/keys", json={"role": "agent", "name": "fuzz"})
        if key.status_code == 200:
            ids["key_id"] = key.json()["id"]
    return ids


@hypothesis_seed(SEED)
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@schema.include(path_regex=r"\{").parametrize()
def test_routes_on_existing_objects(case: Any, live_url: str, known_ids: dict[str, str]) -> None:
    """The same checks with path ids that exist, so the handlers behind the 404s run too."""
    if case.path_parameters:
        case.path_parameters = {k: known_ids.get(k, v) for k, v in case.path_parameters.items()}
    call_and_check(case, live_url)


class IdleTrainer:
    """Stands in for the Megatron ranks (outside the unit: the job routes and the job's loop are under test):
    trains nothing, checkpoints nothing, pushes nowhere, so a job stays live for the fuzz."""

    def train_step(self, samples: Any, **kwargs: Any) -> dict[str, float]:
        return {"loss": 0.0}

    def compute_logprobs(self, samples: Any, reference: bool = False) -> list[list[float]]:
        return [[0.0] * len(s.tokens) for s in samples]

    def compute_values(self, samples: Any) -> list[list[float]]:
        return [[0.0] * len(s.tokens) for s in samples]

    def train_critic(self, samples: Any, old_values: Any) -> dict[str, float]:
        return {}

    def save_checkpoint(self, path: str) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        return path

    def load_checkpoint(self, path: str) -> dict[str, int]:
        return {}

    def push_weights(self, engine_urls: Any, version: Any, bucket_bytes: Any = None) -> dict[str, Any]:
        return {"seconds": 0.0}

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def live_job(live_url: str) -> Iterator[Any]:
    """``live_job()``: the id of a running (or paused) job, started again whenever the fuzz cancelled it."""
    import httpx

    def current() -> str:
        with httpx.Client(base_url=live_url, timeout=120) as http:
            active = [j for j in http.get("/jobs").json()["data"] if j["status"] in ("queued", "running", "paused")]
            if active:
                return active[0]["id"]
            r = http.post("/jobs", json={"name": "fuzz-live", "loop": {"batch_size": 64}})
            assert r.status_code == 200, r.text
            return r.json()["id"]

    yield current
    with httpx.Client(base_url=live_url, timeout=120) as http:
        for j in http.get("/jobs").json()["data"]:
            if j["status"] in ("queued", "running", "paused"):
                http.post(f"/jobs/{j['id']}/cancel")


@hypothesis_seed(SEED)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@schema.include(path_regex=r"^/jobs/\{job_id\}").parametrize()
def test_job_routes_on_a_live_job(case: Any, live_url: str, live_job: Any, request: pytest.FixtureRequest) -> None:
    """Pause, resume, cancel, checkpoint, metrics, evals and events of a job whose loop is running."""
    manager = _manager(request)
    manager.make_trainer = lambda spec: IdleTrainer()
    try:
        case.path_parameters = {**case.path_parameters, "job_id": live_job()}
        if case.path.endswith("/events"):  # following a live job's events streams until the job ends
            case.query = {**(case.query or {}), "follow": "false"}
        call_and_check(case, live_url, LIVE_STATUSES)
    finally:
        manager.make_trainer = _refuse_trainer


def _manager(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("live_app").state.gw.jobs


def test_the_fuzzer_really_generated() -> None:
    """Guards the fuzz above: good requests really reached the engine and were answered."""
    if not STATUSES:
        pytest.skip("checks what the fuzz tests of this module sent; run it with them")
    ok = {path for (_, path, status) in STATUSES if status == 200}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/sessions/{session_id}", "/jobs/{job_id}/events",
            "/v1/responses/{response_id}/feedback", "/v1/sessions/{session_id}/reward", "/v1/responses",
            "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens"} <= ok, STATUSES
    live = {(method, path) for (method, path, status) in LIVE_STATUSES if status == 200}
    print("job routes answered 200 on a live job:", sorted(live))
    assert ("GET", "/jobs/{job_id}") in live and any(method == "POST" for method, _ in live), LIVE_STATUSES
