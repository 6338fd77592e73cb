"""Two Ray nodes (Ray's own ``ray.cluster_utils.Cluster``: a head and a second raylet on this machine),
engines placed on one by a node resource and the trainer ranks on the other, the same placement code a
real cluster takes. The engines bind beyond loopback, so the deployment makes its engine key and every
caller (router, gateway, supervisor, trainer) must send it. A live job trains 3 steps; its pushes go
through SGLang's broadcast path (``/init_weights_update_group`` + ``/update_weights_from_distributed``)
from the trainer's node to the engines' node, and the engines then report the job's version.

The second test makes the addresses real: the head node (with the server and the trainer ranks) in one
network namespace, the engines' node in another, joined by a veth link; Ray runs with its token, as the
compose file and README's recipe start it, and ``serve`` is the command README gives. Nothing tells the
pusher to broadcast: it chooses the distributed path because the engine's address is not local. A LoRA job
follows: each adapter version is written on the engines' host (a Ray task there) and loaded by path, since
shared memory does not reach it."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from slime_server.utils.procs import kill_group
from tests._jobs_helpers import ADMIN, AGENT, create_paced, job_events, start_stack
from tests._netns_helpers import netns_pids, two_namespaces

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


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
    r = create_paced(client, model=model, max_tokens=6, temperature=1.0, seed=i,
                     messages=[{"role": "user", "content": f"Count to {i % 7}."}])
    text = r.choices[0].message.content or ""
    with httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {AGENT}"}) as c:
        c.post(f"/sessions/{sid}/reward", json={"reward": float(len(text) % 3 == 0) + random.random()}
               ).raise_for_status()
        c.post(f"/sessions/{sid}/close").raise_for_status()


def test_job_on_two_nodes_pushes_across_with_the_engine_key(cluster: Any, tiny_model_path: Path,
                                                             tmp_path: Path) -> None:
    import ray

    running = start_stack(tiny_model_path, tmp_path,
                          engine={"host": "0.0.0.0", "ray_resources": {"engine_node": 1}},
                          ray={"address": cluster.address},
                          trainer={"ray_resources": {"trainer_node": 1}, "weight_sync": "distributed"})
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
        # a small buffer: while the trainer's ranks start on the other node, the episodes are paced (429 +
        # Retry-After, waited out) instead of piling up hundreds the job never trains on
        body = {"name": "two-nodes", "algorithm": "reinforce_plus_plus", "optimizer": {"lr": 1e-3},
                "loop": {"batch_size": 4, "max_steps": 3, "checkpoint_interval": 10, "poll_interval_s": 0.05},
                "pacing": {"max_buffered": 8, "retry_after_s": 0.25}}
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
        pushes = [e["data"] for e in job_events(admin, job_id) if e["kind"] == "weights_pushed"]
        assert [p["version"] for p in pushes][-1] == version and len(pushes) >= 3
        assert {p["mode"] for p in pushes} == {"distributed"}  # the broadcast path, across the nodes
        info = httpx.get(f"{url}/model_info", timeout=10, headers={"Authorization": f"Bearer {key}"}).json()
        assert info["weight_version"] == str(version)
    finally:
        running.stop()


NET = "10.213.8"  # the two test hosts' own link (made here, removed after)
BIN = Path(sys.executable).parent

DRIVER = textwrap.dedent("""
    import json, random, sys, tempfile, time, uuid, httpx
    from pathlib import Path
    from openai import OpenAI, RateLimitError
    base, agent, admin_key, key_file, out = sys.argv[1:6]
    admin = httpx.Client(base_url=base, timeout=300, headers={"Authorization": f"Bearer {admin_key}"})
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    model = admin.get("/v1/models").raise_for_status().json()["data"][0]["id"]
    LOOP = {"batch_size": 4, "max_steps": 3, "checkpoint_interval": 10, "poll_interval_s": 0.05}
    PACING = {"max_buffered": 8, "retry_after_s": 0.25}

    def events_of(job_id):
        with admin.stream("GET", f"/jobs/{job_id}/events", params={"follow": "false"}) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]

    def play(job_id, name):  # rewarded episodes on `name` until the job completes
        i, t0 = 0, time.monotonic()
        while (j := admin.get(f"/jobs/{job_id}").raise_for_status().json())["status"] != "completed":
            assert j["status"] not in ("failed", "cancelled") and time.monotonic() - t0 < 300, j
            sid = f"netns-{uuid.uuid4().hex[:10]}"
            client = OpenAI(base_url=f"{base}/v1", api_key=agent, default_headers={"X-Session-Id": sid},
                            max_retries=0)
            while True:  # buffer pacing (429 + Retry-After) is waited out, as an agent would
                try:
                    client.chat.completions.create(model=name, max_tokens=6, temperature=1.0, seed=i,
                                                   messages=[{"role": "user", "content": f"Count to {i % 7}."}])
                    break
                except RateLimitError as e:
                    assert "buffer is full" in str(e) and time.monotonic() - t0 < 300, e
                    time.sleep(float(e.response.headers.get("retry-after", "1")))
            h = {"Authorization": f"Bearer {agent}"}
            httpx.post(f"{base}/v1/sessions/{sid}/reward", json={"reward": random.random()},
                       headers=h).raise_for_status()
            httpx.post(f"{base}/v1/sessions/{sid}/close", headers=h).raise_for_status()
            i += 1
        return j

    job = admin.post("/jobs", json={"name": "netns", "algorithm": "reinforce_plus_plus", "optimizer": {"lr": 1e-3},
                                    "loop": LOOP, "pacing": PACING}).raise_for_status().json()
    j = play(job["id"], model)
    events = events_of(job["id"])
    # a LoRA job: each adapter version reaches the engine on the other host as files on its disk (through Ray)
    lora = admin.post("/jobs", json={"name": "netns-lora", "algorithm": "reinforce_plus_plus",
                                     "optimizer": {"lr": 1e-3}, "lora": {"rank": 4, "name": "netns-lora"},
                                     "loop": {**LOOP, "max_steps": 2}, "pacing": PACING}).raise_for_status().json()
    t0 = time.monotonic()
    while not any(e["kind"] == "adapter_published" for e in events_of(lora["id"])):  # version 0 (B = 0) served
        assert time.monotonic() - t0 < 300, admin.get(f"/jobs/{lora['id']}").json()
        time.sleep(0.5)
    lora_job = play(lora["id"], f"{model}:netns-lora")
    engines = admin.get("/dashboard/api/engines").raise_for_status().json()["engines"]
    key = open(key_file).read().strip()
    url = engines[0]["url"]
    # the engine drops the version (as its LRU evicts one): the next request on the alias is answered, whether the
    # engine reloads it from the path it loaded it from (the gateway's view of the engines still has it) or the
    # gateway loads the saved version again (its view refreshed, after waiting it out), staged on the engine's host
    rec = next(a for a in admin.get("/admin/adapters").raise_for_status().json()["data"] if a["alias"] == "netns-lora")
    reloaded = []
    auth = {"Authorization": f"Bearer {key}"}
    for wait in (0.0, 2.5):
        served = httpx.get(f"{url}/v1/models", headers=auth, timeout=60).raise_for_status().json()["data"]
        for name in [m["id"] for m in served if m["id"].startswith("netns-lora@")]:
            httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": name}, headers=auth,
                       timeout=60).raise_for_status()
        time.sleep(wait)
        again = OpenAI(base_url=f"{base}/v1", api_key=agent, max_retries=0).chat.completions.create(
            model=f"{model}:netns-lora", max_tokens=4, messages=[{"role": "user", "content": "Hi."}])
        reloaded.append(again.choices[0].finish_reason)
    def staged_of():  # this job's versions staged on the engine's host (the two hosts share /tmp here)
        d = Path(tempfile.gettempdir()) / "slime-adapters"
        return sorted(p.name for p in d.iterdir() if f"@{lora['id']}." in p.name) if d.is_dir() else []

    time.sleep(4)  # the job's left versions are unloaded 3 s after they leave
    kept = staged_of()
    admin.delete("/admin/adapters/netns-lora").raise_for_status()  # the alias deleted: its copies go too
    for _ in range(100):
        if not staged_of():
            break
        time.sleep(0.2)
    res = {"job": j, "pushes": [e["data"] for e in events if e["kind"] == "weights_pushed"], "engines": engines,
           "lora_job": lora_job, "reloaded": reloaded, "current": rec["name"], "staged": kept,
           "staged_after_delete": staged_of(),
           "published": [e["data"] for e in events_of(lora["id"]) if e["kind"] == "adapter_published"],
           "keyless": httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "x"}).status_code,
           "model_info": httpx.get(f"{url}/model_info", headers={"Authorization": f"Bearer {key}"}).json()}
    json.dump(res, open(out, "w"))
""")


def _titles(ns: str) -> set[str]:
    """The Ray actor process titles (``ray::EngineActor``, ...) running in namespace ``ns``."""
    out = set()
    for pid in netns_pids(ns):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:
            continue
        if title.startswith("ray::"):
            out.add(title.split()[0].split(".")[0])
    return out


def _start(cmd: list[str], env: dict[str, str], log: Path, ready: str | None, timeout: float = 120) -> Any:
    with log.open("ab") as out:  # exactly ``env`` (spawn would add this process's RAY_* and SLIME_* back)
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while ready is not None and ready not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return proc


def test_job_across_two_network_namespaces(tiny_model_path: Path, tmp_path: Path) -> None:
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_urlsafe(32) + "\n")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLIME_"))} | {
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1"}
    head = f"{NET}.1:6379"
    # Both nodes keep their sessions, sockets and the cluster address file here, not in /tmp/ray, where a
    # ray_current_cluster naming this (soon dead) cluster would be picked up by later ray.init() calls.
    temp = tempfile.mkdtemp(prefix="rns", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    procs: list[Any] = []
    with two_namespaces(NET) as (a, b):
        try:
            procs.append(_start(["ip", "netns", "exec", a, str(BIN / "ray"), "start", "--head", "--block",
                                 f"--node-ip-address={NET}.1", "--port=6379", "--num-cpus=2",
                                 '--resources={"trainer_node": 2}', "--include-dashboard=false",
                                 "--disable-usage-stats", f"--temp-dir={temp}"], env, tmp_path / "head.log",
                                "Ray runtime started"))
            procs.append(_start(["ip", "netns", "exec", b, str(BIN / "ray"), "start", "--block", f"--address={head}",
                                 f"--node-ip-address={NET}.2", "--num-cpus=2", '--resources={"engine_node": 2}',
                                 "--disable-usage-stats", f"--temp-dir={temp}"], env, tmp_path / "worker.log",
                                "Ray runtime started"))
            serve_env = env | {"SLIME_ENGINE__RAY_RESOURCES": '{"engine_node": 1}',
                               "SLIME_TRAINER__RAY_RESOURCES": '{"trainer_node": 1}',
                               "SLIME_TRAINER__WORK_DIR": str(tmp_path / "jobs")}
            procs.append(_start(["ip", "netns", "exec", a, str(BIN / "slime-server"), "serve", "--ray-address", head,
                                 "--ray-auth-token-file", str(token), "--engine-host", "0.0.0.0", "--model",
                                 str(tiny_model_path), "--num-engines", "1", "--enable-lora", "--port", "8000",
                                 "--api-key", AGENT,
                                 "--admin-api-key", ADMIN, "--db-path", str(tmp_path / "db.sqlite"),
                                 "--log-dir", str(tmp_path / "logs")], serve_env, tmp_path / "serve.log", None))
            out = tmp_path / "result.json"
            driver = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-c", DRIVER, "http://127.0.0.1:8000",
                                       AGENT, ADMIN, str(tmp_path / "logs" / "engine_api_key"), str(out)], env=env)
            seen: dict[str, set[str]] = {a: set(), b: set()}
            while driver.poll() is None:  # where each actor runs, while the job's trainer ranks are alive
                for ns in (a, b):
                    seen[ns] |= _titles(ns)
                time.sleep(0.2)
            assert driver.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
        finally:
            for p in reversed(procs):
                kill_group(p, timeout=10)
            shutil.rmtree(temp, ignore_errors=True)
    from ray._common.utils import get_ray_address_file

    assert f"{NET}.1" not in (Path(get_ray_address_file(None)).read_text()
                              if Path(get_ray_address_file(None)).exists() else "")  # /tmp/ray left alone
    res = json.loads(out.read_text())
    assert res["job"]["step"] == 3 and res["job"]["policy_version"] == 3
    assert len(res["pushes"]) >= 3 and {p["mode"] for p in res["pushes"]} == {"distributed"}  # chosen, not forced
    (engine,) = res["engines"]
    assert httpx.URL(engine["url"]).host == f"{NET}.2" and engine["weight_version"] == "3"  # through the key
    assert res["model_info"]["weight_version"] == "3" and res["keyless"] == 401
    assert res["lora_job"]["step"] == 2  # the LoRA job's versions, loaded by the engine from files on its host
    assert [p["version"] for p in res["published"]] == [0, 1, 2]
    assert {p["mode"] for p in res["published"]} == {"adapter-staged"} and all(p["bytes"] > 0 for p in res["published"])
    assert all(r in ("stop", "length") for r in res["reloaded"]), res["reloaded"]  # loaded on its host again
    # the version served keeps its staged copy (the engine reloads from it); the left versions' went with them,
    # and the last one's with the alias
    assert len(res["staged"]) == 1 and res["staged"][0].startswith(res["current"] + "-"), res
    assert res["staged_after_delete"] == [], res
    assert "ray::EngineActor" in seen[b] and "ray::EngineActor" not in seen[a]
    assert "ray::TrainerRank" in seen[a] and "ray::TrainerRank" not in seen[b]
