"""Per-job W&B logging (``JobSpec.wandb``): a job's step metrics reach its W&B run (offline mode, no
network), and a server without the ``wandb`` package refuses such a job with a clear 400."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slime_server.buffer.job_store import SQLiteJobStore
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.jobs.errors import JobError
from slime_server.jobs.manager import JobManager
from slime_server.jobs.spec import JobSpec
from tests._loop_helpers import RecordingTrainer, add


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[JobManager]:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    db = tmp_path / "db.sqlite"
    store = SQLiteTrajectoryStore(db)
    for i in range(4):
        add(store, f"s-{i}", reward=float(i % 2))
    m = JobManager(store, SQLiteJobStore(db), lambda spec: RecordingTrainer(), list, tmp_path / "jobs")
    yield m
    m.shutdown()
    store.close()


def spec(**wandb: str) -> JobSpec:
    return JobSpec.model_validate({"name": "wb", "loop": {"batch_size": 2, "poll_interval_s": 0.05,
                                                          "checkpoint_interval": 1000},
                                   "wandb": {"project": "slime-test", **wandb}})


def test_job_metrics_reach_wandb(manager: JobManager, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    view = manager.create(spec(mode="offline"))
    deadline = time.monotonic() + 60
    # the step count is persisted a moment before the step's metrics row: wait for both
    while manager.get(view.id).step < 2 or not manager.metrics(view.id) or manager.metrics(view.id)[-1].step < 2:
        assert manager.get(view.id).status != "failed", manager.get(view.id).error
        assert time.monotonic() < deadline, manager.get(view.id)
        time.sleep(0.05)
    run = manager._running[view.id].tb.run
    assert (run.id, run.name, run.project) == (view.id, "wb", "slime-test")
    stored = manager.metrics(view.id)[-1]
    assert stored.step == 2
    keys = ("step", "loss", "reward_mean", "policy_version", "tokens_per_s")
    want = {"step": 2, **{k: stored.metrics[k] for k in keys[1:]}}
    # The step is stored before it is logged, and W&B's backend applies a logged row in its own process
    # (CI once read step 2 beside step 1's loss): wait for the summary to show step 2's row, or fail.
    deadline = time.monotonic() + 30
    while True:
        summary = dict(run.summary)  # the last logged value of each metric
        if all(k in summary and summary[k] == pytest.approx(want[k]) for k in keys):
            break
        assert time.monotonic() < deadline, (summary, want)
        time.sleep(0.1)
    assert manager.cancel(view.id).status == "cancelled"
    job_dir = tmp_path / "jobs" / view.id
    assert list((job_dir / "wandb").glob(f"offline-run-*-{view.id}/run-{view.id}.wandb"))
    assert list((job_dir / "tb").glob("events.out.tfevents.*"))  # TensorBoard as always


def test_job_without_wandb_installed_is_refused(manager: JobManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(JobError) as e:
        manager.create(spec())
    assert e.value.status_code == 400 and e.value.code == "wandb_not_installed"
    assert "pip install" in str(e.value)
    assert manager.list() == []  # refused before anything was stored
    assert manager.create(spec(mode="disabled")).status in ("queued", "running")  # disabled needs no package
