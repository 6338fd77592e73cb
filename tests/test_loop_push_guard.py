"""The loop enters ``push_guard`` (serve: ``EngineSupervisor.updating_weights``) around every window in which
engines are paused for weights: each push, each catch-up push, and in sync mode the whole pause ... resume
(train step included). Recording stand-ins for the ranks and engines; the real pair runs in
test_supervisor_health.py (supervisor + router + engine) and test_jobs_e2e.py (loop + ranks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.trainer.loop import EngineControl, TrainLoop
from slime_server.trainer.settings import LoopSettings
from tests._loop_helpers import RecordingTrainer, add


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteTrajectoryStore]:
    s = SQLiteTrajectoryStore(tmp_path / "buffer.db")
    yield s
    s.close()


class Log:
    def __init__(self) -> None:
        self.entries: list[str] = []
        self.depth = 0

    @contextmanager
    def guard(self) -> Iterator[None]:
        self.depth += 1
        self.entries.append("guard:enter")
        try:
            yield
        finally:
            self.depth -= 1
            self.entries.append("guard:exit")

    def note(self, what: str) -> None:
        self.entries.append(f"{what}{'(guarded)' if self.depth else ''}")


class LoggedTrainer(RecordingTrainer):
    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log

    def train_step(self, samples: Any, **kw: Any) -> dict[str, float]:
        self.log.note("train")
        return super().train_step(samples, **kw)

    def push_weights(self, urls: Any, version: Any, bucket_bytes: Any = None) -> dict[str, float]:
        self.log.note(f"push{list(urls)}")
        return super().push_weights(urls, version, bucket_bytes)


class LoggedEngines(EngineControl):
    def __init__(self, log: Log) -> None:
        super().__init__(lambda: ["http://e1"])
        self.log = log

    def pause(self) -> None:
        self.log.note("pause")

    def resume(self) -> None:
        self.log.note("resume")


def _loop(store: SQLiteTrajectoryStore, tmp_path: Path, log: Log, **settings: Any) -> TrainLoop:
    trainer = LoggedTrainer(log)
    lp = TrainLoop(store, lambda: trainer, LoggedEngines(log), LoopSettings(batch_size=2, **settings), tmp_path,
                   job_id="job-x", push_guard=log.guard)
    lp.trainer = trainer
    return lp


def test_async_step_guards_only_the_push(store: SQLiteTrajectoryStore, tmp_path: Path) -> None:
    log = Log()
    lp = _loop(store, tmp_path, log)
    for i in range(2):
        add(store, f"s{i}", reward=float(i))
    assert lp.step_once() is not None
    assert log.entries == ["train", "guard:enter", "push['http://e1'](guarded)", "guard:exit"]


def test_sync_step_guards_pause_train_push_resume(store: SQLiteTrajectoryStore, tmp_path: Path) -> None:
    log = Log()
    lp = _loop(store, tmp_path, log, sync=True)
    for i in range(2):
        add(store, f"s{i}", reward=float(i))
    assert lp.step_once() is not None
    assert log.entries == ["guard:enter", "pause(guarded)", "train(guarded)", "guard:enter",
                           "push['http://e1'](guarded)", "guard:exit", "resume(guarded)", "guard:exit"]


def test_catch_up_push_is_guarded(store: SQLiteTrajectoryStore, tmp_path: Path) -> None:
    log = Log()
    lp = _loop(store, tmp_path, log)
    assert lp.sync_engine("http://e2") is True
    assert log.entries == ["guard:enter", "push['http://e2'](guarded)", "guard:exit"]


def test_the_guard_is_left_when_the_push_fails(store: SQLiteTrajectoryStore, tmp_path: Path) -> None:
    log = Log()
    lp = _loop(store, tmp_path, log)

    def broken(*a: Any, **k: Any) -> dict[str, float]:
        raise RuntimeError("engine gone")

    lp.trainer.push_weights = broken  # type: ignore[union-attr,method-assign]
    with pytest.raises(RuntimeError):
        lp.sync_engine("http://e2")
    assert log.entries == ["guard:enter", "guard:exit"] and log.depth == 0


def test_serve_wires_the_supervisor_guard_into_every_job_loop(store: SQLiteTrajectoryStore, tmp_path: Path) -> None:
    """``serve``: ``attach_jobs(push_guard=supervisor.updating_weights)`` reaches each loop the manager builds."""
    from types import SimpleNamespace

    from slime_server.config import GatewaySettings, ServerSettings
    from slime_server.server.serve_cmd import attach_jobs

    log = Log()
    gw_settings = GatewaySettings(port=1, db_path=str(tmp_path / "jobs.db"))
    gw = SimpleNamespace(settings=gw_settings, store=store, model_name="tiny", jobs=None,
                         adapters=SimpleNamespace(aliases=None))
    settings = ServerSettings(trainer={"work_dir": str(tmp_path / "work")})
    jobs = attach_jobs(gw, settings, "/m", lambda: [], push_guard=log.guard)
    lp = _loop(store, tmp_path, Log())
    lp.push_guard = lambda: pytest.fail("not replaced")  # type: ignore[assignment,misc]
    jobs.loop_hook(lp)
    assert lp.push_guard == log.guard
    with lp.push_guard():
        pass
    assert log.entries == ["guard:enter", "guard:exit"]
