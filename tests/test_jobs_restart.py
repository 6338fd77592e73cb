"""A job survives a server restart: its state is in the store, and the new server's trainer resumes
from the last checkpoint, puts back what the lost steps had consumed, and goes on training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._jobs_helpers import (
    create_job,
    drive,
    engine_versions,
    start_stack,
    store_trajectories,
    wait_event,
    wait_job,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _start(model: Path, work: Path) -> Any:
    return start_stack(model, work)


def test_job_resumes_after_server_restart(tiny_model_path: Path, tmp_path: Path) -> None:
    first = _start(tiny_model_path, tmp_path)
    try:
        j = create_job(first, batch_size=4, checkpoint_interval=2, max_staleness=None)
        wait_event(first, j["id"], "trainer_ready")
        sessions = drive(first, 12)
        j = wait_job(first, j["id"], lambda j: j["step"] >= 3)
    finally:
        first.stop()  # like a crash of the control plane between steps: the job is still "running"
    assert j["checkpoints"][-1]["step"] == 2
    second = _start(tiny_model_path, tmp_path)
    try:
        resumed = wait_event(second, j["id"], "resumed")["data"]
        assert resumed["from_step"] == 2
        assert resumed["released_trajectories"] >= 4  # step 3's batch goes back into the pool
        again = wait_job(second, j["id"], lambda x: x["step"] >= 3 and x["status"] == "running")
        assert again["policy_version"] > j["policy_version"]  # restored weights, new version number
        sessions += drive(second, 4)
        done = wait_job(second, j["id"], lambda x: x["step"] >= 4)
        assert engine_versions(second) == [str(done["policy_version"])]
        trajs = store_trajectories(second, sessions)
        assert len(trajs) == 16 and sum(t.consumed_step is not None for t in trajs) >= 16
        with httpx.Client(base_url=second.base_url.removesuffix("/v1"),
                          headers={"Authorization": "Bearer admin-key"}) as c:
            assert c.post(f"/jobs/{j['id']}/cancel").json()["status"] == "cancelled"
    finally:
        second.stop()
