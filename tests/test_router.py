"""The real sgl-router in front of real CPU engine processes: routing, worker add/remove at run time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from slime_server.config import RouterSettings
from slime_server.rollout.actors import EngineActor, EngineSpec
from slime_server.rollout.router import RouterError, RouterProcess, build_router_cmd
from tests._rollout_helpers import generate_body, pid_alive, served_generate_count

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def engines(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineActor]]:
    pytest.importorskip("slime_server.rollout.engine_server", reason="the CPU engine is not in this tree yet")
    logs = tmp_path_factory.mktemp("engines")
    actors = [EngineActor(EngineSpec(model_path=str(tiny_model_path), log_path=str(logs / f"e{i}.log"),
                                     startup_timeout_s=120), start=False, monitor=False) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:  # engines load in parallel
        list(pool.map(EngineActor.start, actors))
    yield actors
    for a in actors:
        a.stop()


@pytest.fixture(scope="module")
def router(engines: list[EngineActor], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    log = tmp_path_factory.mktemp("router") / "router.log"
    with RouterProcess(RouterSettings(policy="round_robin"), log_path=log) as r:
        r.start(worker_urls=[engines[0].url(), engines[1].url()])
        deadline = time.monotonic() + 60
        while len(r.worker_urls(healthy_only=True)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield r


def _generate(router_url: str, n: int) -> list[dict]:
    out = []
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            r = c.post(f"{router_url}/generate", json=generate_body(seed=i))
            assert r.status_code == 200, r.text
            out.append(r.json())
    return out


def test_build_router_cmd_sets_ports_policy_and_extra_args() -> None:
    s = RouterSettings(policy="cache_aware", host="127.0.0.1", extra_args={"queue_size": 8, "disable_retries": True,
                                                                          "cors_allowed_origins": ["a", "b"]})
    cmd = build_router_cmd(s, port=1234, prometheus_port=1235, worker_urls=["http://127.0.0.1:1"])
    assert cmd[1:3] == ["-m", "slime_server.rollout.router_launch"]  # sgl-router's launcher + the key from env
    pairs = dict(zip(cmd[3::1], cmd[4::1], strict=False))
    assert pairs["--port"] == "1234" and pairs["--prometheus-port"] == "1235" and pairs["--policy"] == "cache_aware"
    assert cmd[cmd.index("--worker-urls") + 1] == "http://127.0.0.1:1"
    assert cmd[-6:] == ["--queue-size", "8", "--disable-retries", "--cors-allowed-origins", "a", "b"]


def test_a_key_or_value_starting_with_a_dash_reaches_the_router_whole() -> None:
    """A generated key starts with "-" once in 64 (base64url): sgl-router's argparse then refused
    ``--api-key -x...`` ("expected one argument") and the router exited 2; seen under CI load."""
    from sglang_router.launch_router import parse_router_args

    from slime_server.rollout.router_launch import router_args

    key = "-x3Gq_" + "a" * 38
    cmd = build_router_cmd(RouterSettings(extra_args={"request_timeout_secs": -1}), port=1234, prometheus_port=1235,
                           worker_urls=["http://127.0.0.1:1"])
    assert "--request-timeout-secs=-1" in cmd
    parsed = parse_router_args(router_args(cmd[3:], key))  # what router_launch hands sgl-router
    assert parsed.api_key == key and parsed.request_timeout_secs == -1
    assert parse_router_args(router_args(cmd[3:], None)).api_key is None


def test_router_runs_without_its_own_health_check_and_circuit_breaker() -> None:
    """As slime launches it: the supervisor is the health monitor (a paused engine is not a dead one)."""
    from sglang_router.launch_router import parse_router_args

    cmd = build_router_cmd(RouterSettings(), port=1234, prometheus_port=1235, worker_urls=["http://127.0.0.1:1"])
    assert "--disable-health-check" in cmd and "--disable-circuit-breaker" in cmd
    assert "--health-check-interval-secs" not in cmd  # meaningless with the check off
    args = parse_router_args(cmd[3:])  # the 0.3.2 launcher's own parser accepts every flag we pass
    assert args.disable_health_check is True and args.disable_circuit_breaker is True
    assert args.port == 1234 and args.prometheus_port == 1235 and args.worker_urls == ["http://127.0.0.1:1"]


def test_generate_through_router_reaches_both_engines(router: RouterProcess, engines: list[EngineActor]) -> None:
    before = [served_generate_count(e) for e in engines[:2]]
    results = _generate(router.url, 6)
    for res in results:
        assert len(res["output_ids"]) == 4
        lps = res["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in lps] == res["output_ids"]
        assert all(isinstance(t[0], float) and t[0] <= 0.0 for t in lps)
    after = [served_generate_count(e) for e in engines[:2]]
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 6
    assert served == [3, 3]  # round_robin, counted by the engines themselves


def test_add_and_remove_worker_at_run_time(router: RouterProcess, engines: list[EngineActor]) -> None:
    third = engines[2]
    router.add_worker(third.url())
    assert third.url() in router.worker_urls(healthy_only=True)
    before = served_generate_count(third)
    _generate(router.url, 6)
    assert served_generate_count(third) - before == 2  # one in three under round_robin

    router.remove_worker(third.url())
    assert third.url() not in router.worker_urls()
    before = [served_generate_count(e) for e in engines]
    _generate(router.url, 4)
    after = [served_generate_count(e) for e in engines]
    assert after[2] == before[2]  # removed: no more traffic
    assert after[0] - before[0] + after[1] - before[1] == 4


def test_bad_worker_urls(tmp_path: Path) -> None:
    with RouterProcess(RouterSettings(), log_path=tmp_path / "r.log") as router:
        router.start()
        _check_bad_worker_urls(router)


def _check_bad_worker_urls(router: RouterProcess) -> None:
    with pytest.raises(ValueError):
        router.add_worker("not a url")
    with pytest.raises(RouterError):
        router.add_worker("http://127.0.0.1:9", timeout=2)  # nothing listens on the discard port
    assert "http://127.0.0.1:9" not in router.worker_urls(healthy_only=True)
    router.remove_worker("http://127.0.0.1:1")  # unknown: no-op


def test_router_process_stops_cleanly(tmp_path: Path) -> None:
    r = RouterProcess(RouterSettings(), log_path=tmp_path / "r.log").start()
    pid = r.pid
    assert pid is not None and Path(f"/proc/{pid}").exists()
    r.close()
    assert not r.is_alive()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{r.url}/health", timeout=2)


def test_router_dies_with_its_owner(tmp_path: Path) -> None:
    """SIGKILL the owning process (no cleanup runs): the kernel must take the router down too."""
    import signal
    import subprocess
    import sys

    code = ("import sys; from slime_server.rollout.router import RouterProcess\n"
            f"r = RouterProcess(log_path={str(tmp_path / 'r.log')!r}).start()\n"
            "print(r.pid, r.url, flush=True); sys.stdin.readline()\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pid_s, url = owner.stdout.readline().split()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pid_alive(int(pid_s)):
        time.sleep(0.1)
    assert not pid_alive(int(pid_s))


def test_sampling_seed_survives_the_router(router: RouterProcess) -> None:
    """SGLang's ``sampling_seed`` goes through sgl-router 0.3.2 to the engines (it dropped ``seed``):
    the same seed reproduces a temperature-1 sample on whichever engine serves it, another seed does not."""
    def sample(seed: int) -> list[int]:
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 1.0, "max_new_tokens": 24,
                                                               "ignore_eos": True, "sampling_seed": seed}}
        r = httpx.post(f"{router.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    first = sample(11)
    assert all(sample(11) == first for _ in range(3))  # round robin: both engines served the same seed
    assert sample(12) != first


def test_a_port_taken_before_the_router_binds_it_is_chosen_again(tmp_path: Path) -> None:
    """The free port we picked for the router's Prometheus exporter is taken before it starts (as Ray's workers
    or another router may): the router exits at once ("Address already in use"), so start() picks again."""
    import socket

    r = RouterProcess(RouterSettings(), log_path=tmp_path / "router.log")
    taken = r.prometheus_port
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((r.settings.host, taken))
        squatter.listen()
        try:
            r.start()
            assert r.prometheus_port != taken and httpx.get(f"{r.url}/health", timeout=5).status_code == 200
            assert "Address already in use" in (tmp_path / "router.log").read_text()  # the first try failed so
        finally:
            r.stop()


def test_a_port_taken_before_an_engine_binds_it_is_chosen_again(tiny_model_path: Path, tmp_path: Path) -> None:
    """The same race for an engine: its chosen port is taken before the CPU engine binds it, the engine exits
    ("address already in use") and its first start chooses another; a fixed port fails as it always did."""
    import socket

    log = tmp_path / "engine.log"
    engine = EngineActor(EngineSpec(model_path=str(tiny_model_path), log_path=str(log), startup_timeout_s=120),
                         start=False, monitor=False)
    with socket.socket() as squatter:
        squatter.bind((engine.spec.host, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        engine.port = taken  # chosen free, then taken by somebody else before the engine started
        try:
            url = engine.start()
            assert engine.port != taken and httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert "address already in use" in log.read_text().lower()  # the first try did fail so
        finally:
            engine.stop()
        fixed = EngineActor(EngineSpec(model_path=str(tiny_model_path), port=taken, log_path=str(tmp_path / "f.log"),
                                       startup_timeout_s=120), start=False, monitor=False)
        with pytest.raises(RuntimeError, match="exited"):
            fixed.start()
        assert fixed.port == taken


def test_a_server_that_took_the_routers_port_is_not_taken_for_the_router(tmp_path: Path) -> None:
    """The router's own port is taken by another HTTP server that answers 2xx (an engine's ``/health`` does, seen
    once in CI): the router dies of "Address already in use" while that server answers; start() must not count
    that as ready, and picks another port."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path == "/health":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")
            else:
                self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    r = RouterProcess(RouterSettings(), log_path=tmp_path / "router.log")
    squatter = ThreadingHTTPServer((r.settings.host, r.port), Healthy)
    taken = r.port
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        r.start()
        assert r.port != taken and r.list_workers() == []  # the real router, on a port of its own
        assert "Address already in use" in (tmp_path / "router.log").read_text()  # the first try did fail
    finally:
        r.stop()
        squatter.shutdown()
        squatter.server_close()
