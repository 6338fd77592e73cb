"""Training modes end to end on the tiny model, CPU (issue 20): an SFT job on a conversation file, a rollout-only
job, and a train-only replay of an export that gives the original job's losses. One server (a CPU engine behind
the real sgl-router, the gateway, the job manager, Megatron-core ranks under Ray) for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests._jobs_helpers import (
    AGENT,
    admin,
    drain_pool,
    drive,
    engine_versions,
    job,
    job_events,
    running_stack,
    wait_event,
    wait_job,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

CONVERSATIONS = [  # four prompts, four answers the tiny model has never said
    ("What colour is the sky?", "The sky is blue."),
    ("Name a prime number.", "Seven is prime."),
    ("Which animal barks?", "A dog barks."),
    ("What do bees make?", "Bees make honey."),
]


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_stack(tiny_model_path, tmp_path_factory.mktemp("modes"), ray={"num_cpus": 3}) as running:
        yield running


def submit(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    with admin(server) as c:
        r = c.post("/jobs", json=body)
        assert r.status_code == 200, r.text
        return r.json()


def metrics(server: Any, job_id: str) -> list[dict[str, Any]]:
    with admin(server) as c:
        return c.get(f"/jobs/{job_id}/metrics").raise_for_status().json()


def greedy(server: Any, prompt: str, *, paced: bool = False) -> str:
    client = OpenAI(base_url=server.base_url, api_key=AGENT, max_retries=0)
    r = client.chat.completions.create(model=Path(server.deployment.model_path).name, temperature=0, max_tokens=16,
                                       messages=[{"role": "user", "content": prompt}],
                                       metadata=None if paced else {"serve_only": "true"})
    return r.choices[0].message.content or ""


def test_sft_job_teaches_the_served_model_its_conversations(server: Any, tmp_path: Path) -> None:
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS))
    before = [greedy(server, q) for q, _ in CONVERSATIONS]
    assert all(b != a for b, (_, a) in zip(before, CONVERSATIONS, strict=True))
    with admin(server) as c:  # a file the served chat template cannot train on is refused at submit time
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
        r = c.post("/jobs", json={"algorithm": "sft", "data": {"source": "conversations", "dataset": str(bad)}})
        assert r.status_code == 400 and "no assistant message" in r.json()["error"]["message"]
    drive(server, 2)  # rewarded episodes nobody consumes: a job that paced /v1 by them would answer 429 below
    j = submit(server, {"name": "sft", "algorithm": "sft", "optimizer": {"lr": 3e-3},
                        "data": {"source": "conversations", "dataset": str(data), "epochs": 40},
                        "loop": {"batch_size": 4, "checkpoint_interval": 100, "poll_interval_s": 0.05},
                        "pacing": {"max_buffered": 1}})
    wait_event(server, j["id"], "trainer_ready")
    greedy(server, "Hello", paced=True)  # a file-fed job consumes nothing from the buffer: /v1 is not paced
    assert job(server, j["id"])["status"] == "running"
    j = wait_job(server, j["id"], lambda j: j["status"] == "completed", timeout=400)
    assert j["step"] == 40  # 40 epochs of 4 conversations in batches of 4: the file ran out, the job completed
    losses = [m["metrics"]["loss"] for m in metrics(server, j["id"])]
    assert len(losses) == 40 and losses[-1] < losses[0] / 10, losses
    assert engine_versions(server) == [str(j["policy_version"])]  # the engines serve the job's last push
    after = [greedy(server, q) for q, _ in CONVERSATIONS]
    assert after == [a for _, a in CONVERSATIONS], after


def test_rollout_only_job_records_episodes_and_trains_nothing(server: Any) -> None:
    drain_pool(server)
    version = engine_versions(server)
    j = submit(server, {"name": "rollout", "train": False,
                        "data": {"source": "dataset", "environment": "calculator", "num_prompts": 3, "epochs": 2,
                                 "concurrency": 4, "max_tokens": 8},
                        "loop": {"batch_size": 2, "n_samples_per_prompt": 2},
                        "pacing": {"max_buffered": 1}})  # nothing consumes: pacing must not stop it
    j = wait_job(server, j["id"], lambda j: j["status"] == "completed", timeout=300)
    assert (j["step"], j["checkpoints"]) == (0, [])
    with admin(server) as c:
        kinds = [e["kind"] for e in job_events(c, j["id"])]
        played = sum(e["data"]["episodes"] for e in job_events(c, j["id"]) if e["kind"] == "episodes")
    assert "trainer_ready" not in kinds and "weights_pushed" not in kinds and kinds[-1] == "completed"
    assert played == 12  # 3 prompts x 2 passes x 2 samples
    store = server.gateway.server.config.app.state.gw.store
    pool = store.list_trajectories(unconsumed=True, status="finished", rewarded=True, limit=1000)
    assert len(pool) == 12 and len({t.group_id for t in pool}) == 6  # recorded, rewarded, in the pool
    assert engine_versions(server) == version


def test_replay_of_an_export_repeats_the_jobs_losses(server: Any, tmp_path: Path) -> None:
    """Export -> train-only job: the asynchronous job's own batches from the same base weights, so the same
    per-step losses and gradient norms; a second replay gives them again (deterministic)."""
    drain_pool(server)
    spec = {"algorithm": "reinforce_plus_plus", "optimizer": {"lr": 1e-3},
            "loop": {"batch_size": 4, "max_staleness": None, "max_steps": 3, "poll_interval_s": 0.05,
                     "checkpoint_interval": 100}}
    orig = submit(server, {**spec, "name": "original"})  # live traffic, rewards with a spread
    drive(server, 16)
    orig = wait_job(server, orig["id"], lambda j: j["status"] == "completed", timeout=400)
    export = tmp_path / "export.jsonl"
    with admin(server) as c:
        export.write_bytes(c.get("/admin/export", params={"status": "all"}).raise_for_status().content)
    lines = [json.loads(x) for x in export.read_text().splitlines()]
    assert sum(x["metadata"]["consumed_job"] == orig["id"] and x["metadata"]["consumed_step"] > 0
               for x in lines) == 12
    replays = []
    for _ in range(2):
        r = submit(server, {**spec, "name": "replay",
                            "data": {"source": "replay", "dataset": str(export), "replay_job": orig["id"]}})
        replays.append(wait_job(server, r["id"], lambda j: j["status"] == "completed", timeout=400))
    keys = ("loss", "grad_norm", "reward_mean", "samples", "trained_tokens")
    want = [(m["step"], *(m["metrics"][k] for k in keys)) for m in metrics(server, orig["id"])]
    assert [w[0] for w in want] == [1, 2, 3]
    assert all(w[1] != 0 and w[2] > 0 for w in want), want  # a real gradient at every step
    for r in replays:
        assert r["step"] == 3
        assert [(m["step"], *(m["metrics"][k] for k in keys)) for m in metrics(server, r["id"])] == want
    # ... though the replays trained in the processes the job before each left (trainer.warm_ranks_s): a rank
    # process kept for another job starts it as a new one would
    with admin(server) as c:
        ready = [next(e["data"] for e in job_events(c, r["id"]) if e["kind"] == "trainer_ready") for r in replays]
    assert [d["warm"] for d in ready] == [True, True], ready
