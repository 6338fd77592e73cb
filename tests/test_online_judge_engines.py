"""The online judge as another model served by the same server: ``serve --online
--judge-engine-model tiny`` starts the judge on an engine of its own behind its own sgl-router
(real Ray, engines, routers, gateways, Megatron trainer). Judge calls go there and are recorded in
the judge's own store, never in the policy's; the judge's engines are not the policy's (weight
pushes target only the policy's router's engines) and stay at their initial weights."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from slime_server.online.simulate import simulate
from slime_server.utils.net import find_free_port
from slime_server.utils.procs import stop_leader
from tests._cli_helpers import CLI, output_lines, wait_for

pytestmark = pytest.mark.timeout(600)


def engine_versions(router_url: str) -> list[str]:
    workers = httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]
    return [str(httpx.get(f"{w['url']}/model_info", timeout=10).json()["weight_version"]) for w in workers]


def test_judge_on_its_own_engines_is_used_and_never_trained(tiny_model_path: Path, tmp_path: Path) -> None:
    port = find_free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [str(CLI), "serve", "--model", "tiny", "--num-engines", "1", "--ray-num-cpus", "2", "--port", str(port),
         "--db-path", str(tmp_path / "online.db"), "--log-dir", str(tmp_path / "logs"),
         "--trainer-work-dir", str(tmp_path / "jobs"), "--online", "--judge-engine-model", "tiny",
         "--judge-engines", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        lines = output_lines(proc)
        router_url = wait_for(lines, "router_url:", 240, proc)
        judge_line = wait_for(lines, "judge_base_url:", 240, proc)
        judge_url, judge_router, judge_db = re.match(
            r"(\S+) \(router (\S+), 1 engine\(s\), calls recorded in (\S+)\)", judge_line).groups()
        wait_for(lines, "online job:", 120, proc)
        wait_for(lines, "openai_base_url:", 60, proc)
        assert judge_url != f"http://127.0.0.1:{port}/v1" and judge_router != router_url
        judge_version = engine_versions(judge_router)

        base = f"http://127.0.0.1:{port}/v1"
        convs = [c for r in range(3) for c in asyncio.run(simulate(base, 8, concurrency=8, seed=r))]
        assert [c.error for c in convs if c.error] == []

        deadline = time.monotonic() + 120  # judging runs in the background, after each next user turn
        judged: list = []
        while len(judged) < 20 and time.monotonic() < deadline:
            time.sleep(1)
            with sqlite3.connect(judge_db) as db:  # every judge call went to the judge's own gateway
                judged = db.execute("SELECT messages FROM trajectories").fetchall()
        assert len(judged) >= 20 and all("User's next message" in m for (m,) in judged)
        with sqlite3.connect(tmp_path / "online.db") as db:  # and none of them into the policy's store
            rows = db.execute("SELECT messages FROM trajectories").fetchall()
        assert rows and not any("User's next message" in m for (m,) in rows)
        policy_workers = {w["url"] for w in httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]}
        judge_workers = {w["url"] for w in httpx.get(f"{judge_router}/workers", timeout=10).json()["workers"]}
        assert len(judge_workers) == 1 and not judge_workers & policy_workers
        assert engine_versions(judge_router) == judge_version
    finally:
        stop_leader(proc)
