"""A live job on the tiny MoE with routing replay (issue 44): ``serve --enable-return-routed-experts`` (engines
answer routes, the gateway records them), agents' episodes through the OpenAI SDK, a REINFORCE++ job with
``moe.routing_replay: rollout`` trains 3 steps replaying every recorded route and pushes its weights into the
engines. Submitting it to a server that records no routes is refused naming the flag. A job with
``routing_replay: trainer`` (R2) needs no recorded routes: two mini-batches a batch, the second replaying the
routing the policy had before the first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._jobs_helpers import admin, drive, engine_versions, running_stack, store_trajectories, wait_job


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from slime_server.models.tiny import ensure_tiny_model, tiny_moe_spec

    path = ensure_tiny_model(spec=tiny_moe_spec())
    with running_stack(path, tmp_path_factory.mktemp("moe-job"), engine={"enable_return_routed_experts": True}) as s:
        yield s


JOB = {"name": "moe-r3", "algorithm": "reinforce_plus_plus", "optimizer": {"lr": 1e-3}, "moe": {"routing_replay": "rollout"},
       "loop": {"batch_size": 4, "n_samples_per_prompt": 1, "max_steps": 3, "checkpoint_interval": 2,
                "poll_interval_s": 0.05}}


def test_a_job_replaying_recorded_routes_trains_and_pushes(server: Any) -> None:
    manager = server.gateway.server.config.app.state.gw.jobs
    with admin(server) as c:
        manager.routes_recorded = False  # as on a server started without the flag
        try:
            refused = c.post("/jobs", json=JOB)
        finally:
            manager.routes_recorded = True
        assert refused.status_code == 400 and "--enable-return-routed-experts" in refused.text
        created = c.post("/jobs", json=JOB)
        assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    sessions = drive(server, 16)
    recorded = store_trajectories(server, sessions)
    assert recorded and all(t.routed_experts is not None and t.routed_experts.positions == len(t.tokens) - 1
                            for t in recorded)
    done = wait_job(server, job_id, lambda j: j["status"] == "completed", timeout=300)
    assert done["step"] == 3 and done["policy_version"] >= 1
    assert set(engine_versions(server)) == {str(done["policy_version"])}
    with admin(server) as c:
        metrics = [row["metrics"] for row in c.get(f"/jobs/{job_id}/metrics").raise_for_status().json()]
    print("\nreplay agreement by step:", [round(m["moe_replay_topk_agreement"], 4) for m in metrics])
    assert len(metrics) == 3
    assert all(m["moe_samples_without_routes"] == 0 for m in metrics)
    # the first step trains the weights the engines sampled with: the trainer's router chose as theirs did
    assert metrics[0]["moe_replay_topk_agreement"] > 0.999
    assert all(0 < m["moe_replay_topk_agreement"] <= 1 for m in metrics)


def test_a_job_replaying_the_old_policys_routes_needs_no_recorded_ones(server: Any) -> None:
    manager = server.gateway.server.config.app.state.gw.jobs
    job = {**JOB, "name": "moe-r2", "moe": {"routing_replay": "trainer"},
           "loop": {**JOB["loop"], "max_steps": 2, "num_steps_per_rollout": 2}}
    with admin(server) as c:
        manager.routes_recorded = False  # R2 records in the trainer: the engines' routes are not asked for
        try:
            created = c.post("/jobs", json=job)
        finally:
            manager.routes_recorded = True
        assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    drive(server, 8)
    done = wait_job(server, job_id, lambda j: j["status"] == "completed", timeout=300)
    assert done["step"] == 2
    with admin(server) as c:
        metrics = [row["metrics"] for row in c.get(f"/jobs/{job_id}/metrics").raise_for_status().json()]
    print("\nR2 agreement by step:", [round(m["moe_replay_topk_agreement"], 4) for m in metrics])
    assert [m["optimizer_steps"] for m in metrics] == [2.0, 2.0]
    assert all(m["moe_samples_without_routes"] == 0 for m in metrics)  # every sample replayed the trainer's routes
    assert all(0 < m["moe_replay_topk_agreement"] <= 1 for m in metrics)


@pytest.mark.parametrize("mode", ["rollout", "trainer"])
def test_routing_replay_on_a_dense_model_is_refused_at_submit(mode: str, tiny_model_path: Path,
                                                              tmp_path: Path) -> None:
    from slime_server.buffer.job_store import SQLiteJobStore
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.jobs.errors import JobError
    from slime_server.jobs.manager import JobManager
    from slime_server.jobs.spec import JobSpec

    db = tmp_path / "db.sqlite"
    manager = JobManager(SQLiteTrajectoryStore(db), SQLiteJobStore(db), lambda spec: None, list, tmp_path / "jobs",
                         model_path=str(tiny_model_path), routes_recorded=True)
    try:
        with pytest.raises(JobError) as refused:
            manager.create(JobSpec.model_validate({**JOB, "moe": {"routing_replay": mode}}))
        assert refused.value.status_code == 400 and "no experts" in str(refused.value), refused.value
        assert manager.jobs.list_jobs() == []  # nothing was queued
    finally:
        manager.shutdown()


def test_r2_on_a_pipelined_trainer_is_refused_at_submit(tmp_path: Path) -> None:
    from slime_server.buffer.job_store import SQLiteJobStore
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.jobs.errors import JobError
    from slime_server.jobs.manager import JobManager
    from slime_server.jobs.spec import JobSpec
    from slime_server.models.tiny import ensure_tiny_model, tiny_moe_spec

    db = tmp_path / "db.sqlite"
    manager = JobManager(SQLiteTrajectoryStore(db), SQLiteJobStore(db), lambda spec: None, list, tmp_path / "jobs",
                         model_path=str(ensure_tiny_model(spec=tiny_moe_spec())), pipeline_stages=2)
    try:
        with pytest.raises(JobError) as refused:
            manager.create(JobSpec.model_validate({**JOB, "moe": {"routing_replay": "trainer"}}))
        assert refused.value.status_code == 400 and "trainer.pp_size" in str(refused.value), refused.value
        assert manager.jobs.list_jobs() == []
    finally:
        manager.shutdown()
