"""Deployment: Ray engine actors + the real sgl-router, grown/shrunk at run time, engines restarted.

That a deployment's own Ray cluster leaves no process behind is checked in test_cli_engines.py."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slime_server.config import EngineSettings, RaySettings, RouterSettings, ServerSettings
from slime_server.server.launch import Deployment
from tests._rollout_helpers import generate_body, pid_alive, served_generate_count

pytest.importorskip("slime_server.rollout.engine_server", reason="the CPU engine is not in this tree yet")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def deployment(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    settings = ServerSettings(
        engine=EngineSettings(model=str(tiny_model_path), num_engines=2, num_cpus_per_engine=0.5,
                              health_interval_s=0.5, startup_timeout_s=120),
        router=RouterSettings(policy="round_robin"),
        ray=RaySettings(num_cpus=2),
    )
    dep = Deployment.start(settings, log_dir=tmp_path_factory.mktemp("deploy"))
    yield dep
    dep.shutdown()


def _generate(url: str, n: int) -> None:
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            r = c.post(f"{url}/generate", json=generate_body(seed=i))
            assert r.status_code == 200, r.text
            assert len(r.json()["meta_info"]["output_token_logprobs"]) == 4


def test_engines_registered_and_serving(deployment: Deployment) -> None:
    urls = deployment.engine_urls
    assert len(urls) == 2 and len(set(urls)) == 2
    assert sorted(deployment.router.worker_urls(healthy_only=True)) == sorted(urls)
    statuses = deployment.engine_status()
    assert all(s.alive and s.healthy and s.kind == "cpu" for s in statuses)
    before = [served_generate_count(u) for u in urls]
    _generate(deployment.router_url, 4)
    assert [served_generate_count(u) - b for u, b in zip(urls, before, strict=True)] == [2, 2]


def test_add_then_remove_engine(deployment: Deployment) -> None:
    new = deployment.add_engine()
    assert new in deployment.router.worker_urls(healthy_only=True)
    before = served_generate_count(new)
    _generate(deployment.router_url, 6)
    assert served_generate_count(new) - before == 2

    pid = next(s.pid for s in deployment.engine_status() if s.url == new)
    assert deployment.remove_engine(new) == new
    assert new not in deployment.engine_urls
    assert new not in deployment.router.worker_urls()
    assert not pid_alive(pid)  # the engine process is gone, not just deregistered
    _generate(deployment.router_url, 2)


def test_dead_engine_is_restarted_on_same_url(deployment: Deployment) -> None:
    url = deployment.engine_urls[0]
    old = next(s for s in deployment.engine_status() if s.url == url)
    os.kill(old.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = next(s for s in deployment.engine_status() if s.url == url)
        if now.healthy and now.pid != old.pid:
            break
        time.sleep(0.5)
    assert now.healthy and now.pid != old.pid and now.restarts == old.restarts + 1
    assert served_generate_count(url) == 0  # a fresh process behind the same URL
    _generate(deployment.router_url, 4)  # the router keeps routing to it: no re-registration needed
    assert served_generate_count(url) == 2
