"""trainer/warm_ranks.py: one idle group at most, taken by its own shape only; another shape, the timeout or
``clear`` stops it. (That a kept rank process trains as a new one does: test_training_modes' replays, warm, repeat
the job's losses exactly; that its buffers leave /dev/shm: test_jobs_e2e's kill -9 test, at the job's end.)"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from slime_server.config import TrainerSettings
from slime_server.server.launch import warm_ranks_s
from slime_server.trainer.warm_ranks import WarmRanks
from slime_server.utils.shm import reap_own


class Group:
    def __init__(self) -> None:
        self.stopped = threading.Event()


def test_a_group_is_taken_by_its_own_shape_once() -> None:
    warm, g = WarmRanks(), Group()
    warm.put(("a", 1), g, g.stopped.set, keep_s=60)
    assert warm.take(("a", 1)) is g
    assert warm.take(("a", 1)) is None  # taken: no longer waiting
    assert not g.stopped.is_set()  # the taker owns it now


def test_another_shape_stops_the_waiting_group() -> None:
    warm, g = WarmRanks(), Group()
    warm.put(("a", 1), g, g.stopped.set, keep_s=60)
    assert warm.take(("a", 2)) is None
    assert g.stopped.is_set() and warm.waiting() is None  # its Ray resources are free for the new group


def test_one_waits_at_a_time_and_clear_stops_it() -> None:
    warm, first, second = WarmRanks(), Group(), Group()
    warm.put("s", first, first.stopped.set, keep_s=60)
    warm.put("s", second, second.stopped.set, keep_s=60)
    assert first.stopped.is_set() and warm.waiting() is second
    warm.clear()
    assert second.stopped.is_set() and warm.waiting() is None


def test_an_idle_group_stops_after_keep_s() -> None:
    warm, g = WarmRanks(), Group()
    t0 = time.monotonic()
    warm.put("s", g, g.stopped.set, keep_s=0.3)
    assert g.stopped.wait(10)
    assert time.monotonic() - t0 >= 0.3 and warm.waiting() is None


def test_a_taken_groups_timer_does_not_stop_it() -> None:
    warm, g = WarmRanks(), Group()
    warm.put("s", g, g.stopped.set, keep_s=0.2)
    assert warm.take("s") is g
    assert not g.stopped.wait(0.6)


def test_a_failing_stop_is_logged_not_raised() -> None:
    warm = WarmRanks()

    def boom() -> None:
        raise RuntimeError("Ray is gone")

    warm.put("s", Group(), boom, keep_s=60)
    warm.clear()  # no exception: the server's end goes on
    assert warm.waiting() is None


def test_cpu_ranks_wait_five_minutes_gpu_ranks_not_unless_asked() -> None:
    assert warm_ranks_s(TrainerSettings()) == 300.0
    assert warm_ranks_s(TrainerSettings(num_gpus_per_rank=1)) == 0.0
    assert warm_ranks_s(TrainerSettings(num_gpus_per_rank=1, warm_ranks_s=60)) == 60.0
    assert warm_ranks_s(TrainerSettings(warm_ranks_s=0)) == 0.0


def test_a_kept_rank_removes_its_own_shared_memory_files_only(tmp_path: Path) -> None:
    """What an engine still maps keeps torch from unlinking a rank's files; a rank kept for the next job removes
    its own (by its pid), never another process's."""
    mine, other = tmp_path / f"torch_{os.getpid()}_1_2", tmp_path / "torch_1_3_4"
    mine.write_bytes(b"x" * 100)
    other.write_bytes(b"y")
    assert reap_own(str(tmp_path)) == (1, 100)
    assert not mine.exists() and other.exists()
