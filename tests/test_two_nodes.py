"""Two Ray nodes (Ray's own ``ray.cluster_utils.Cluster``: a head and a second raylet on this machine),
engines placed on one by a node resource and the trainer ranks on the other, the same placement code a
real cluster takes. The engines bind beyond loopback, so the deployment makes its engine key and every
caller (router, gateway, supervisor, trainer) must send it. A live job trains 3 steps; its pushes go
through SGLang's broadcast path (``/init_weights_update_group`` + ``/update_weights_from_distributed``)
from the trainer's node to the engines' node, and the engines then report the job's version."""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from slime_server.utils.net import find_free_port

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ADMIN = "two-node-admin"
AGENT = "two-node-agent"


@pytest.fixture
def cluster() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():  # an earlier test's local Ray: this test must join the cluster instead
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"engine_node": 2}})
    c.add_node(num_cpus=2, resources={"trainer_node": 2})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _episode(base_url: str, model: str, i: int) -> None:
    sid = f"two-{uuid.uuid4().hex[:10]}"
    client = OpenAI(base_url=base_url, api_key=AGENT, default_headers={"X-Session-Id": sid}, max_retries=0)
    r = client.chat.completions.create(model=model, max_tokens=6, temperature=1.0, seed=i,
                                       messages=[{"role": "user", "content": f"Count to {i % 7}."}])
    text = r.choices[0].message.content or ""
    with httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {AGENT}"}) as c:
        c.post(f"/sessions/{sid}/reward", json={"reward": float(len(text) % 3 == 0) + random.random()}
               ).raise_for_status()
        c.post(f"/sessions/{sid}/close").raise_for_status()


def _events(admin: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    import json

    with admin.stream("GET", f"/jobs/{job_id}/events", params={"follow": "false"}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_job_on_two_nodes_pushes_across_with_the_engine_key(cluster: Any, tiny_model_path: Path,
                                                             tmp_path: Path) -> None:
    import ray

    from slime_server.api.serve_cmd import start_server
    from slime_server.config import load_settings

    settings = load_settings(None, {
        "engine": {"model": str(tiny_model_path), "num_engines": 1, "host": "0.0.0.0",
                   "ray_resources": {"engine_node": 1}},
        "ray": {"address": cluster.address},
        "trainer": {"work_dir": str(tmp_path / "jobs"), "ray_resources": {"trainer_node": 1},
                    "weight_sync": "distributed"},
        "gateway": {"port": find_free_port(), "db_path": str(tmp_path / "db.sqlite"), "api_key": AGENT,
                    "admin_api_key": ADMIN},
    })
    running = start_server(settings, settings.gateway, tmp_path / "logs")
    trainer_nodes: list[list[str]] = []
    make_trainer = running.jobs.make_trainer

    def placed_trainer(spec: Any) -> Any:  # the job's group, asked where its ranks run while they are alive
        group = make_trainer(spec)
        trainer_nodes.append(group.node_ids())
        return group

    running.jobs.make_trainer = placed_trainer
    try:
        dep = running.deployment
        key = dep.engine_api_key
        assert key and (tmp_path / "logs" / "engine_api_key").read_text() == key  # generated: engines bind 0.0.0.0
        (url,) = dep.engine_urls
        assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "x"}, timeout=10).status_code == 401
        head = ray.get_runtime_context().get_node_id()  # the driver runs on the head, as `serve` on a head node
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        (engine_status,) = dep.engine_status()
        assert "engine_node" in nodes[engine_status.node_id] and engine_status.node_id == head

        admin = httpx.Client(base_url=running.base_url.removesuffix("/v1"), timeout=300,
                             headers={"Authorization": f"Bearer {ADMIN}"})
        body = {"name": "two-nodes", "algorithm": "reinforce_plus_plus", "optimizer": {"lr": 1e-3},
                "loop": {"batch_size": 4, "max_steps": 3, "checkpoint_interval": 10, "poll_interval_s": 0.05}}
        r = admin.post("/jobs", json=body)
        assert r.status_code == 200, r.text
        job_id = r.json()["id"]
        model = Path(dep.model_path).name
        deadline = time.monotonic() + 400
        i = 0
        with ThreadPoolExecutor(4) as pool:
            while (j := admin.get(f"/jobs/{job_id}").raise_for_status().json())["status"] != "completed":
                assert j["status"] not in ("failed", "cancelled"), j
                assert time.monotonic() < deadline, j
                list(pool.map(lambda k: _episode(running.base_url, model, k), range(i, i + 4)))
                i += 4
        assert j["step"] == 3
        version = j["policy_version"]
        assert version == 3

        (ranks,) = trainer_nodes
        assert ranks and engine_status.node_id not in ranks
        assert all("trainer_node" in nodes[n] for n in ranks)
        pushes = [e["data"] for e in _events(admin, job_id) if e["kind"] == "weights_pushed"]
        assert [p["version"] for p in pushes][-1] == version and len(pushes) >= 3
        assert {p["mode"] for p in pushes} == {"distributed"}  # the broadcast path, across the nodes
        info = httpx.get(f"{url}/model_info", timeout=10, headers={"Authorization": f"Bearer {key}"}).json()
        assert info["weight_version"] == str(version)
    finally:
        running.stop()
