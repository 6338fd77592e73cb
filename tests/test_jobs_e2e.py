"""The closed loop on the tiny model, CPU: openai SDK traffic -> buffer -> Megatron-core trainer ranks
(Ray actors) -> bucketed weight push -> the live engines, controlled over the /jobs REST API.

One server (2 CPU engines behind the real sgl-router, the gateway, the job manager) serves every
test of this module; each test runs its own job and cancels it.
"""

from __future__ import annotations

import json
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

from slime_server.trainer.selection import min_version
from slime_server.utils.net import find_free_port

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ADMIN = "admin-key"
AGENT = "agent-key"


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from slime_server.api.serve_cmd import start_server
    from slime_server.config import load_settings

    work = tmp_path_factory.mktemp("jobs")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    settings = load_settings(None, {
        "engine": {"model": str(tiny_model_path), "num_engines": 2},
        "ray": {"num_cpus": 4},
        "trainer": {"work_dir": str(work / "jobs")},
        "gateway": {"port": find_free_port(), "db_path": str(work / "db.sqlite"), "api_key": AGENT,
                    "admin_api_key": ADMIN},
    })
    running = start_server(settings, settings.gateway, work / "logs")
    try:
        yield running
    finally:
        running.stop()


def admin(server: Any) -> httpx.Client:
    return httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=300,
                        headers={"Authorization": f"Bearer {ADMIN}"})


def rest(server: Any) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {AGENT}"})


def episode(server: Any, i: int, *, metadata: dict[str, str] | None = None) -> str:
    """One session: a chat turn through the OpenAI SDK, a reward, close. Returns the session id."""
    sid = f"ep-{uuid.uuid4().hex[:12]}"
    client = OpenAI(base_url=server.base_url, api_key=AGENT, default_headers={"X-Session-Id": sid}, max_retries=0)
    r = client.chat.completions.create(model=Path(server.deployment.model_path).name, max_tokens=6, temperature=1.0,
                                       messages=[{"role": "user", "content": f"Count to {i % 7}."}], seed=i,
                                       metadata=metadata)
    text = r.choices[0].message.content or ""
    with rest(server) as c:
        c.post(f"/sessions/{sid}/reward", json={"reward": float(len(text) % 3 == 0) + random.random() * 0.1}
               ).raise_for_status()
        c.post(f"/sessions/{sid}/close").raise_for_status()
    return sid


def drive(server: Any, n: int, concurrency: int = 4) -> list[str]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda i: episode(server, i), range(n)))


def create_job(server: Any, pacing: dict[str, Any] | None = None, loss: dict[str, Any] | None = None,
               algorithm: str = "reinforce_plus_plus", **loop: Any) -> dict[str, Any]:
    body = {"name": "test", "algorithm": algorithm, "optimizer": {"lr": 1e-3},
            "loop": {"batch_size": 4, "checkpoint_interval": 2, "poll_interval_s": 0.05, **loop},
            "pacing": pacing or {}, "loss": loss or {}}
    with admin(server) as c:
        r = c.post("/jobs", json=body)
        assert r.status_code == 200, r.text
        return r.json()


def job(server: Any, job_id: str) -> dict[str, Any]:
    with admin(server) as c:
        return c.get(f"/jobs/{job_id}").raise_for_status().json()


def wait_job(server: Any, job_id: str, pred, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        j = job(server, job_id)
        if pred(j):
            return j
        assert j["status"] not in ("failed",), j["error"]
        if time.monotonic() > deadline:
            store = server.gateway.server.config.app.state.gw.store
            pool = [(t.id[-6:], t.status, t.reward, t.consumed_step, sorted({v for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m}))
                    for t in store.list_trajectories(limit=10_000)][-30:]
            raise AssertionError(f"timed out; job is {j}; stats {store.stats()}; last trajectories {pool}")
        time.sleep(0.2)


def drain_pool(server: Any) -> None:
    """Earlier tests' unused data must not blur exact counts: take it out of the pool (it stays stored)."""
    store = server.gateway.server.config.app.state.gw.store
    store.mark_consumed([t.id for t in store.list_trajectories(unconsumed=True, limit=10_000)], -1)


def wait_event(server: Any, job_id: str, kind: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        with admin(server) as c:
            found = [e for e in _events(c, job_id) if e["kind"] == kind]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no {kind!r} event"
        time.sleep(0.3)


def cancel(server: Any, job_id: str) -> dict[str, Any]:
    with admin(server) as c:
        r = c.post(f"/jobs/{job_id}/cancel")
        assert r.status_code == 200, r.text
        return r.json()


def engine_versions(server: Any) -> list[str]:
    return [httpx.get(f"{u}/model_info", timeout=10).json()["weight_version"]
            for u in server.deployment.engine_urls]


def store_trajectories(server: Any, session_ids: list[str]) -> list[Any]:
    store = server.gateway.server.config.app.state.gw.store
    return [t for sid in session_ids for t in store.get_trajectories(sid)]


def test_live_job_trains_and_pushes_while_serving(server: Any) -> None:
    j = create_job(server, max_staleness=None)  # keep every sample: the step count below is exact
    assert j["status"] in ("queued", "running") and j["policy_version"] == 0
    wait_event(server, j["id"], "trainer_ready")
    first = drive(server, 24)  # every call must succeed, including those that race a weight push
    j = wait_job(server, j["id"], lambda j: j["step"] >= 5)
    later = drive(server, 20)
    j = wait_job(server, j["id"], lambda j: j["step"] >= 10)
    version = j["policy_version"]
    assert version >= 10
    # every engine switched to the job's newest pushed version (pushes run every step)
    deadline = time.monotonic() + 30
    while engine_versions(server) != [str(job(server, j["id"])["policy_version"])] * 2:
        assert time.monotonic() < deadline, (engine_versions(server), job(server, j["id"]))
        time.sleep(0.2)
    # later turns were generated by newer policies, and the buffer says so token by token
    early_versions = {v for t in store_trajectories(server, first[:4]) for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m}
    late_versions = {v for t in store_trajectories(server, later[-4:]) for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m}
    assert early_versions == {0}
    assert min(late_versions) >= 5
    with admin(server) as c:
        metrics = c.get(f"/jobs/{j['id']}/metrics").raise_for_status().json()
        assert [m["step"] for m in metrics][:10] == list(range(1, 11))
        assert {"loss", "reward_mean", "staleness_mean", "tokens_per_s", "policy_version"} <= set(metrics[-1]["metrics"])
        ckpts = c.get(f"/jobs/{j['id']}/checkpoints").raise_for_status().json()["data"]
        assert [ck["step"] for ck in ckpts][:5] == [2, 4, 6, 8, 10]
        prom = c.get("/metrics").text
        assert f'slime_job_step{{job="{j["id"]}"}}' in prom
    assert list((Path(server.jobs.work_dir) / j["id"] / "tb").glob("events.out.tfevents.*"))
    assert cancel(server, j["id"])["status"] == "cancelled"


def test_kl_job_keeps_a_reference_and_corrects_off_policy_by_default(server: Any) -> None:
    """Issue 19: a job with a KL loss runs (its ranks keep the base weights as reference): the KL is 0 on the
    first step, when the policy still is the base, and grows after; TIS is on (an asynchronous job)."""
    drain_pool(server)
    j = create_job(server, max_staleness=None, loss={"kl_coef": 0.01, "kl_type": "low_var_kl"})
    wait_event(server, j["id"], "trainer_ready")
    drive(server, 12)
    j = wait_job(server, j["id"], lambda j: j["step"] >= 3)
    with admin(server) as c:
        steps = [m["metrics"] for m in c.get(f"/jobs/{j['id']}/metrics").raise_for_status().json()][:3]
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0.0 and steps[2]["kl"] > 0.0, [m["kl"] for m in steps]
    assert all(m["tis_weight_mean"] > 0 for m in steps) and "tis_clip_fraction" in steps[0]
    cancel(server, j["id"])


def test_ppo_job_trains_a_critic_and_checkpoints_it(server: Any) -> None:
    """Issue 19: algorithm 'ppo' runs with a value model in the ranks: GAE advantages, a critic step per batch
    (value loss and explained variance reported), the critic checkpointed beside the policy."""
    drain_pool(server)
    j = create_job(server, algorithm="ppo", max_staleness=None, checkpoint_interval=2)
    wait_event(server, j["id"], "trainer_ready")
    drive(server, 8)
    j = wait_job(server, j["id"], lambda j: j["step"] >= 2 and j["checkpoints"])
    with admin(server) as c:
        steps = [m["metrics"] for m in c.get(f"/jobs/{j['id']}/metrics").raise_for_status().json()][:2]
    assert all("value_loss" in m and "explained_variance" in m and "value_grad_norm" in m for m in steps), steps
    assert Path(j["checkpoints"][-1]["path"] + "-critic").is_dir()
    cancel(server, j["id"])


def test_pause_resume_cancel_and_pacing(server: Any) -> None:
    j = create_job(server, batch_size=2, max_staleness=None)
    jid = j["id"]
    with admin(server) as c:
        assert c.post(f"/jobs/{jid}/pause").json()["status"] == "paused"
        assert c.post(f"/jobs/{jid}/pause").status_code == 409  # already paused
        paused_at = job(server, jid)["step"]
        drive(server, 6)  # traffic goes on while paused
        time.sleep(1.5)
        assert job(server, jid)["step"] == paused_at
        assert c.post(f"/jobs/{jid}/resume").json()["status"] == "running"
    wait_job(server, jid, lambda j: j["step"] >= paused_at + 3)
    with admin(server) as c:
        r = c.post("/jobs", json={"name": "second"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_active"
        r = c.get("/jobs", headers={"Authorization": f"Bearer {AGENT}"})
        assert r.status_code == 403  # the agent key cannot control jobs
    n_before = len(server.gateway.server.config.app.state.gw.store.list_trajectories(limit=10_000))
    done = cancel(server, jid)
    assert done["status"] == "cancelled"
    assert server.jobs._running.get(jid) is None  # loop and trainer ranks are gone
    assert len(server.gateway.server.config.app.state.gw.store.list_trajectories(limit=10_000)) == n_before
    with admin(server) as c:
        assert c.post(f"/jobs/{jid}/resume").status_code == 409

    # pacing: a paused job with a tiny buffer limit answers 429 to training traffic, not to serve-only
    waiting = server.gateway.server.config.app.state.gw.store.stats().unconsumed_finished_rewarded
    j = create_job(server, pacing={"max_buffered": waiting + 2}, batch_size=64)
    body = {"model": Path(server.deployment.model_path).name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    with rest(server) as c:  # an episode under way before the buffer fills: its later turns are never paced
        mid = {"X-Session-Id": f"mid-{uuid.uuid4().hex[:8]}"}
        assert c.post("/chat/completions", json=body, headers=mid).status_code == 200
    drive(server, 2, concurrency=1)
    time.sleep(0.6)  # the buffered count is cached for 0.5 s
    with rest(server) as c:
        r = c.post("/chat/completions", json=body)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "buffer_full"
        r = c.post("/chat/completions", json=body, headers={"X-Session-Id": f"new-{uuid.uuid4().hex[:8]}"})
        assert r.status_code == 429  # a new episode waits
        r = c.post("/chat/completions", json={**body, "metadata": {"serve_only": "true"}})
        assert r.status_code == 200, r.text
        r = c.post("/chat/completions", headers=mid, json={**body, "messages": [
            *body["messages"], {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]})
        assert r.status_code == 200, r.text  # the started episode finishes: its group can complete
    cancel(server, j["id"])


def tour_episode(server: Any, group_id: str | None = None) -> str:
    """README's tour: a chat turn in a session, then a scalar reward (which finishes it); no close."""
    with rest(server) as c:
        sid = c.post("/sessions", json={"group_id": group_id} if group_id else {}).raise_for_status().json()["id"]
        c.post("/chat/completions", headers={"X-Session-Id": sid}, json={
            "model": Path(server.deployment.model_path).name, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
        assert c.post(f"/sessions/{sid}/reward", json={"reward": random.random()}).json()["finished"] is True
    return sid


def test_a_job_says_why_it_waits_and_incomplete_groups_cannot_wedge_v1(server: Any) -> None:
    """Issue 17: groups of 2 but sessions opened without a group id (each alone in its group): the job says
    why it does not train, the buffer fills and pacing refuses new episodes, then the incomplete groups
    expire (dropped, counted), /v1 admits again, and grouped episodes train."""
    drain_pool(server)
    j = create_job(server, algorithm="grpo", pacing={"max_buffered": 3}, batch_size=2, n_samples_per_prompt=2,
                   group_timeout_s=8, max_staleness=None)
    wait_event(server, j["id"], "trainer_ready")  # the groups' clock must not run out while the ranks start
    lone = [tour_episode(server) for _ in range(3)]
    j = wait_job(server, j["id"], lambda j: "3 sessions in incomplete groups" in (j["waiting"] or ""))
    assert j["waiting"].startswith("waiting for complete groups of 2: 0 of 2 samples ready")
    assert j["step"] == 0
    with admin(server) as c:
        events = [e for e in _events(c, j["id"]) if e["kind"] == "waiting"]
    assert events and events[-1]["data"]["reason"] == j["waiting"]
    time.sleep(0.6)  # the buffered count is cached for 0.5 s
    with rest(server) as c:
        r = c.post("/sessions", json={})
        r = c.post("/chat/completions", headers={"X-Session-Id": r.json()["id"]}, json={
            "model": Path(server.deployment.model_path).name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429  # the buffer is full of groups that cannot complete
    j = wait_job(server, j["id"], lambda j: j["dropped_incomplete"] == 3, timeout=60)
    assert [t.consumed_step for t in store_trajectories(server, lone)] == [-1] * 3  # out of the pool, still stored
    time.sleep(0.6)
    group = f"g-{uuid.uuid4().hex[:8]}"
    [tour_episode(server, group) for _ in range(2)]  # admitted again; a whole group trains
    j = wait_job(server, j["id"], lambda j: j["step"] >= 1)
    assert j["dropped_incomplete"] == 3
    cancel(server, j["id"])


def test_stale_data_is_dropped_and_counted(server: Any) -> None:
    drain_pool(server)
    j = create_job(server, batch_size=4, max_staleness=1, stale_policy="drop")
    with admin(server) as c:
        c.post(f"/jobs/{j['id']}/pause").raise_for_status()
    wait_event(server, j["id"], "trainer_ready")  # its first push (if any) is done: no version moves below
    start = job(server, j["id"])
    drive(server, 12)  # all generated by the current policy; the trainer then falls behind by 2 steps
    with admin(server) as c:
        c.post(f"/jobs/{j['id']}/resume").raise_for_status()
    done = wait_job(server, j["id"], lambda j: j["step"] >= start["step"] + 2 and j["dropped_stale"] >= 4)
    assert done["step"] == start["step"] + 2  # 4 + 4 trained, the last 4 (lag 2 > 1) dropped
    assert done["dropped_stale"] == 4
    with admin(server) as c:
        last = c.get(f"/jobs/{j['id']}/metrics").json()[-1]["metrics"]
        assert last["staleness_max"] <= 1
    cancel(server, j["id"])


def test_kill_9_of_a_trainer_rank_restarts_from_checkpoint(server: Any) -> None:
    drain_pool(server)
    j = create_job(server, batch_size=4, checkpoint_interval=2, max_staleness=None)
    wait_event(server, j["id"], "trainer_ready")
    sessions = drive(server, 16)
    j = wait_job(server, j["id"], lambda j: j["step"] >= 2 and j["checkpoints"])
    trainer = server.jobs._running[j["id"]].loop.trainer
    os.kill(trainer.pids()[0], 9)
    sessions += drive(server, 12)  # serving goes on while the trainer is down
    # 28 trajectories = 7 batches: the steps lost with the rank are redone from the checkpoint
    j = wait_job(server, j["id"], lambda j: j["restarts"] >= 1 and j["step"] >= 7)
    assert j["step"] == 7 and j["status"] == "running"
    with admin(server) as c:
        events = _events(c, j["id"])
    kinds = [e["kind"] for e in events]
    assert "trainer_restart" in kinds and "resumed" in kinds
    resumed = next(e["data"] for e in events if e["kind"] == "resumed")
    assert resumed["from_step"] in [ck["step"] for ck in j["checkpoints"]]
    # nothing acknowledged was lost: every rewarded trajectory is stored and was trained on
    trajs = store_trajectories(server, sessions)
    assert len(trajs) == 28 and all(t.reward is not None for t in trajs)
    assert all(t.consumed_step is not None and t.consumed_step >= 1 for t in trajs), json.dumps(
        [[(t.consumed_step, min_version(t)) for t in trajs], [(e["kind"], e["data"].get("step"), e["data"].get("version")) for e in events]])
    deadline = time.monotonic() + 30
    while engine_versions(server) != [str(job(server, j["id"])["policy_version"])] * 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancel(server, j["id"])


def _events(c: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    import json

    out = []
    with c.stream("GET", f"/jobs/{job_id}/events", params={"follow": "false"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


def test_dataset_job_plays_environment_episodes_in_groups(server: Any, tmp_path: Path) -> None:
    drain_pool(server)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with admin(server) as c:  # a job that cannot start fails cleanly and does not block the next one
        r = c.post("/jobs", json={"data": {"source": "dataset", "environment": "calculator", "dataset": str(empty)}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "job_start_failed"
    body = {"name": "calc", "algorithm": "grpo", "optimizer": {"lr": 1e-3},
            "data": {"source": "dataset", "environment": "calculator", "num_prompts": 8, "concurrency": 4,
                     "max_tokens": 24},
            "loop": {"batch_size": 4, "n_samples_per_prompt": 2, "max_staleness": None, "poll_interval_s": 0.05,
                     "checkpoint_interval": 100},
            "eval": [{"name": "calc-heldout", "environment": "calculator", "num_prompts": 4, "every_steps": 2,
                      "max_tokens": 24}]}
    with admin(server) as c:
        r = c.post("/jobs", json={**body, "data": {**body["data"], "environment": "no-such-env"}})
        assert r.status_code == 400 and "no-such-env" in r.json()["error"]["message"]
        j = c.post("/jobs", json=body).raise_for_status().json()
    j = wait_job(server, j["id"], lambda j: j["step"] >= 2)
    episodes = wait_event(server, j["id"], "episodes")["data"]
    assert episodes["episodes"] == 4 and episodes["errors"] == 0  # 2 prompts x 2 samples per round
    store = server.gateway.server.config.app.state.gw.store
    trained = [t for t in store.list_trajectories(limit=10_000) if t.consumed_step is not None and t.consumed_step > 0
               and (t.group_id or "").startswith("grp-")]  # the runner's groups
    by_group: dict[str, int] = {}
    for t in trained:
        by_group[t.group_id or t.id] = by_group.get(t.group_id or t.id, 0) + 1
    assert by_group and all(n == 2 for n in by_group.values())  # whole GRPO groups only
    deadline = time.monotonic() + 120
    while True:  # evaluated before training (step 0) and after step 2, per policy version
        with admin(server) as c:
            evals = c.get(f"/jobs/{j['id']}/evals").raise_for_status().json()["data"]
        if 0 in {e["step"] for e in evals} and max(e["step"] for e in evals) >= 2:
            break
        assert time.monotonic() < deadline, evals
        time.sleep(0.5)
    e0 = next(e for e in evals if e["step"] == 0)
    assert e0["name"] == "calc-heldout" and e0["episodes"] == 4 and e0["errors"] == 0
    wins = e0["success_rate"] * e0["episodes"]
    assert wins == round(wins)  # a share of these 4 episodes, not a rate from elsewhere
    assert max(evals, key=lambda e: e["step"])["version"] > e0["version"]
    evaluated = [t for t in store.list_trajectories(limit=10_000)
                 if store.get_session(t.session_id).metadata.get("serve_only")]
    assert evaluated and all(t.reward is None for t in evaluated)  # eval episodes are never rewarded
    cancel(server, j["id"])
    n = len(store.list_trajectories(limit=10_000))
    time.sleep(1.0)
    assert len(store.list_trajectories(limit=10_000)) == n  # the driver stopped with the job


def test_train_command_follows_a_job_to_its_end_and_exits_with_its_outcome(server: Any, tmp_path: Path) -> None:
    """Issue 20: ``slime-server train CONFIG.yaml`` submits, follows step by step, prints the summary and exits 0
    when the job completes; a spec the trainer cannot run exits 2 with the spec's message; ``jobs`` lists it."""
    import subprocess
    import sys

    import yaml

    drain_pool(server)
    url = server.base_url.removesuffix("/v1")
    spec = {"name": "cli", "algorithm": "grpo", "optimizer": {"lr": 1e-3},
            "data": {"source": "dataset", "environment": "calculator", "num_prompts": 8, "concurrency": 4,
                     "max_tokens": 24},
            "loop": {"batch_size": 4, "n_samples_per_prompt": 2, "max_staleness": None, "poll_interval_s": 0.05,
                     "checkpoint_interval": 100}}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec))
    cli = [sys.executable, "-m", "slime_server.cli"]
    auth = ["--url", url, "--admin-key", ADMIN]
    done = subprocess.run([*cli, "train", str(config), "--max-steps", "2", "--poll-s", "0.2", *auth],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    job_id = done.stdout.split()[1]
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")] == ["1", "2"]
    assert f"job {job_id} completed: 2 steps" in done.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"algorithm": "grpo", "loop": {"n_samples_per_prompt": 1}}))
    refused = subprocess.run([*cli, "train", str(bad), *auth], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "subtracts its group's mean reward" in refused.stderr
    listed = subprocess.run([*cli, "jobs", "list", *auth], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and any(line.startswith(job_id) and "completed" in line
                                          for line in listed.stdout.splitlines())
