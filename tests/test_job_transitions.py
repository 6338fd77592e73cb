"""A job's state changes race its own thread: a pause that lands while a queued job starts stays a pause (a CI run
saw the start overwrite it with ``running`` while the loop stayed paused, so ``resume`` answered 409 and the job
could be neither resumed nor ever finish). The real manager and job store; the trainer stands in (outside the unit)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from slime_server.buffer.job_store import SQLiteJobStore
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.jobs.manager import JobManager
from slime_server.jobs.spec import JobSpec
from tests._loop_helpers import RecordingTrainer


def test_a_pause_while_the_job_starts_stays_a_pause(tmp_path: Path) -> None:
    db = tmp_path / "db.sqlite"
    store, jobs = SQLiteTrajectoryStore(db), SQLiteJobStore(db)
    manager = JobManager(store, jobs, lambda spec: RecordingTrainer(), list, tmp_path / "jobs")
    read, pauses = jobs.get_job, []

    def get_job(job_id: str):  # the job's thread reads its row, still queued: a pause arrives right then
        row = read(job_id)
        if threading.current_thread().name == f"job-{job_id}" and row is not None and row.status == "queued" \
                and not pauses:
            pause = threading.Thread(target=manager.pause, args=(job_id,))
            pause.start()
            pauses.append(pause)  # started: the test's thread may join it from now on
            pause.join(timeout=1.0)  # done at once, unless the start holds the transitions' lock meanwhile
        return row

    jobs.get_job = get_job  # type: ignore[method-assign]
    try:
        view = manager.create(JobSpec.model_validate({"name": "race", "loop": {"batch_size": 2,
                                                                                "poll_interval_s": 0.05}}))
        deadline = time.monotonic() + 30
        while not pauses and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pauses, "the job's thread never read its queued row"
        pauses[0].join(timeout=30)
        assert manager.get(view.id).status == "paused"
        assert manager._running[view.id].loop.paused.is_set()
        assert manager.resume(view.id).status == "running"
        assert not manager._running[view.id].loop.paused.is_set()
    finally:
        manager.shutdown()
        store.close()
