"""The engine supervisor as the health monitor behind a router whose own checks are off (as slime runs
sgl-router), and ``updating_weights()``: an engine paused for a weight update is not a dead engine.

Real parts: a CPU engine process, the real sgl-router 0.3.2 (health check and circuit breaker off, with
the aggressive thresholds they would have used given anyway, to show they do nothing), the supervisor's
threads. In front of the engine sits a thin proxy that answers ``/health_generate`` (and ``/health``) as
SGLang 0.5.23 does while generation is paused: the probe's generate request waits for the pause to end,
and after ``HEALTH_CHECK_TIMEOUT`` the answer is 503 (``http_server.health_generate``,
``tokenizer_manager.generate_request`` waiting on ``is_pause_cond``). Our CPU engine answers 200 at once
while paused, which would make this test pass without the guard.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from slime_server.config import RouterSettings
from slime_server.rollout.router import RouterProcess
from slime_server.rollout.supervisor import EngineSupervisor
from slime_server.server.gateway_thread import GatewayThread
from slime_server.utils.net import find_free_port
from tests._engine_helpers import engine_process
from tests._rollout_helpers import generate_body

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------- unit: verdicts, no engine process

class _FakeRouter:
    def __init__(self) -> None:
        self.removed: list[str] = []
        self.added: list[str] = []

    def remove_worker(self, url: str) -> None:
        self.removed.append(url)

    def add_worker(self, url: str, wait: bool = True) -> str:
        self.added.append(url)
        return "id"


class _StubEngine:
    """``/model_info`` answers; ``/health_generate`` answers ``health_status`` (503: cannot generate)."""

    def __init__(self) -> None:
        self.health_status = 503
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/model_info":
                    code, body = 200, json.dumps({"weight_version": "3"}).encode()
                elif self.path == "/health_generate":
                    code, body = outer.health_status, b""
                else:
                    code, body = 404, b""
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[_StubEngine]:
    s = _StubEngine()
    yield s
    s.close()


def test_failing_probes_count_only_outside_weight_updates(stub: _StubEngine) -> None:
    router = _FakeRouter()
    sup = EngineSupervisor(lambda: [stub.url], router, health_timeout_s=1.0, health_failure_threshold=2)
    try:
        with sup.updating_weights():
            with sup.updating_weights():  # blocks nest (a push and a catch-up push may overlap)
                pass
            assert sup.health_suspended  # the outer block still holds
            for _ in range(4):
                sup.check_health()
                sup.tick()
            assert router.removed == [] and sup.serving_urls() == [stub.url]
        assert not sup.health_suspended
        sup.check_health()
        sup.tick()
        assert router.removed == []  # one failure: below the threshold (counting restarted at zero)
        sup.check_health()
        sup.tick()
        assert router.removed == [stub.url] and ("unhealthy", stub.url) in sup.events
        assert sup.quarantined() == [stub.url]

        # it generates again: the next health round readmits it (same version as last seen, no job)
        stub.health_status = 200
        sup.tick()
        assert router.added == []  # no passing probe since it was taken out yet
        sup.check_health()
        sup.tick()
        assert router.added == [stub.url] and sup.quarantined() == []
    finally:
        sup.stop()


def test_a_gone_process_is_taken_out_even_during_an_update() -> None:
    """Connection refused is not a pause: nothing listens, so the router must stop sending there."""
    dead = f"http://127.0.0.1:{find_free_port()}"
    router = _FakeRouter()
    sup = EngineSupervisor(lambda: [dead], router)
    try:
        with sup.updating_weights():
            sup.tick()
        assert router.removed == [dead] and ("quarantined", dead) in sup.events
        assert ("unhealthy", dead) not in sup.events
    finally:
        sup.stop()


def test_a_probe_spanning_the_end_of_an_update_is_no_verdict(stub: _StubEngine) -> None:
    """A probe that started while the engines were paused and failed after the resume counts for nothing."""
    router = _FakeRouter()
    sup = EngineSupervisor(lambda: [stub.url], router, health_failure_threshold=1)
    block = sup.updating_weights()
    block.__enter__()
    probe = sup._probe  # noqa: SLF001 - end the update while the probe is in flight

    def probe_then_resume(url: str) -> bool:
        ok = probe(url)
        block.__exit__(None, None, None)
        return ok

    sup._probe = probe_then_resume  # type: ignore[method-assign]
    try:
        sup.check_health()
        sup.tick()
        assert router.removed == []
    finally:
        sup.stop()


# ---------------------------------------------------------------- end to end: real engine and router

def _sglang_like_front(backend: str, hang_s: float = 20.0) -> FastAPI:
    """Forwards everything to ``backend`` (our CPU engine), except ``/health_generate`` and ``/health``,
    which wait while the engine is paused and answer 503 after ``hang_s``, as SGLang does."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=backend, timeout=None)

    async def paused() -> bool:
        r = await client.get("/server_info")
        return bool(r.json()["internal_states"][0]["paused"])

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate() -> Response:
        deadline = time.monotonic() + hang_s
        while await paused():
            if time.monotonic() > deadline:
                return Response(status_code=503)
            await asyncio.sleep(0.05)
        return Response(status_code=(await client.get("/health_generate")).status_code)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        r = await client.request(request.method, f"/{path}", params=request.query_params,
                                 content=await request.body(),
                                 headers={"content-type": request.headers.get("content-type", "application/json")})
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return app


@pytest.fixture
def paused_capable_engine(tiny_model_path: Path, tmp_path: Path) -> Iterator[str]:
    """A CPU engine behind the SGLang-like front; yields the front's URL (what router and supervisor see)."""
    with engine_process(tiny_model_path, tmp_path) as backend:
        port = find_free_port()
        front = GatewayThread(_sglang_like_front(backend), "127.0.0.1", port).start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            front.stop()


def _in_router(router: RouterProcess, url: str) -> bool:
    return any(w.url == url and w.is_healthy for w in router.list_workers())


def test_paused_engine_stays_in_the_router_during_a_weight_update(paused_capable_engine: str,
                                                                  tmp_path: Path) -> None:
    url = paused_capable_engine
    # the thresholds the router would use if its checks ran: a 1 s check, 1 s timeout, 1 failure, and a
    # circuit breaker opening on the first failure. Off, they must change nothing.
    aggressive = {"health_check_interval_secs": 1, "health_check_timeout_secs": 1, "health_failure_threshold": 1,
                  "cb_failure_threshold": 1}
    with RouterProcess(RouterSettings(extra_args=aggressive), log_path=tmp_path / "router.log") as router, \
            httpx.Client(timeout=60) as http:
        router.start(worker_urls=[url])
        deadline = time.monotonic() + 30
        while not _in_router(router, url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _in_router(router, url)
        sup = EngineSupervisor(lambda: [url], router, interval_s=0.1, health_interval_s=0.3, health_timeout_s=0.5,
                               health_failure_threshold=2).start()
        try:
            # 1. control: a pause outside any update is a failing engine (about 2 s here), taken out, and
            #    readmitted once it generates again (same version, no job to catch it up)
            http.post(f"{url}/pause_generation", json={"mode": "in_place"}).raise_for_status()
            deadline = time.monotonic() + 20
            while ("unhealthy", url) not in sup.events and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ("unhealthy", url) in sup.events and url not in router.worker_urls()
            http.post(f"{url}/continue_generation", json={}).raise_for_status()
            while ("readmitted", url) not in sup.events and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ("readmitted", url) in sup.events and _in_router(router, url)
            events_before = list(sup.events)

            # 2. the same pause inside updating_weights(), for much longer than any threshold above
            with sup.updating_weights(), ThreadPoolExecutor(4) as pool:
                http.post(f"{url}/pause_generation", json={"mode": "in_place"}).raise_for_status()
                futures = [pool.submit(http.post, f"{router.url}/generate", json=generate_body(seed=i))
                           for i in range(4)]
                paused_at = time.monotonic()
                while time.monotonic() - paused_at < 5.0:
                    assert _in_router(router, url), "a paused engine left the router during an update"
                    time.sleep(0.25)
                assert not any(f.done() for f in futures)  # held by the pause, not failed
                with pytest.raises(httpx.ReadTimeout):  # what every probe meanwhile saw, as on SGLang
                    httpx.get(f"{url}/health_generate", timeout=0.5)
                http.post(f"{url}/continue_generation", json={}).raise_for_status()
                answers = [f.result(timeout=60) for f in futures]
            assert [r.status_code for r in answers] == [200] * 4, [r.text[:200] for r in answers]
            assert all(len(r.json()["output_ids"]) == 4 for r in answers)
            assert sup.events == events_before  # nothing taken out, nothing readmitted

            # 3. after the update the verdicts are back, from zero failures: a healthy engine stays
            time.sleep(1.5)
            assert sup.events == events_before and _in_router(router, url) and not sup.health_suspended
        finally:
            sup.stop()
