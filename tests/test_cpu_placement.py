"""CPU placement (engine.cpus, trainer.cpus): every thread of a pinned engine runs on its cores only, torch's
pool included; a core the host lacks is a clear error at start, not a silent no-op. The trainer's ranks are
checked where a Ray group is set up anyway (tests/test_trainer_tp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from slime_server.config import parse_cpu_list
from slime_server.rollout.actors import EngineSpec, engine_command
from slime_server.utils.affinity import format_cpu_list
from tests._engine_helpers import engine_process_and_pid, thread_affinities


def test_core_lists_parse_as_taskset_writes_them() -> None:
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list(" 5 , 1-2 ") == [1, 2, 5]
    assert parse_cpu_list([3, 1, 3]) == [1, 3]
    assert parse_cpu_list(2) == [2]
    assert parse_cpu_list(None) is None
    assert format_cpu_list(parse_cpu_list("0-2,7")) == "0,1,2,7"
    for bad in ("2-1", "x", "1-", "-1", "", [], [-1]):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    assert engine_command(EngineSpec(model_path="/m", cpus=[0, 2]), 1)[-2:] == ["--cpus", "0,2"]
    assert "--cpus" not in engine_command(EngineSpec(model_path="/m"), 1)
    sglang = engine_command(EngineSpec(kind="sglang", model_path="/m", cpus=[1, 2, 3]), 1)
    assert sglang[:3] == ["taskset", "-c", "1,2,3"] and sglang[4:6] == ["-m", "sglang.launch_server"]


def test_pinning_moves_threads_already_running() -> None:
    """A Ray worker runs threads before a rank sets up: each is moved, not only the caller."""
    last = max(os.sched_getaffinity(0))
    code = ("import threading, time, os\n"
            "from slime_server.utils.affinity import pin_process\n"
            "ev = threading.Event()\n"
            "t = threading.Thread(target=ev.wait, daemon=True); t.start()\n"
            f"pin_process([{last}])\n"
            "print(len(os.listdir('/proc/self/task')), sorted({tuple(sorted(os.sched_getaffinity(int(x))))"
            " for x in os.listdir('/proc/self/task')}))\n"
            "ev.set(); t.join()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == f"2 [({last},)]"


def test_a_pinned_engine_runs_every_thread_on_its_cores(tiny_model_path: Path, tmp_path: Path) -> None:
    last = max(os.sched_getaffinity(0))
    with engine_process_and_pid(tiny_model_path, tmp_path, "--num-threads", "2", "--cpus", str(last)) as (url, pid):
        r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
        pinned = thread_affinities(pid)
    assert len(pinned) > 2  # uvicorn's loop, torch's pool, the scheduler: not only the main thread
    assert set(map(frozenset, pinned.values())) == {frozenset({last})}


def test_a_core_the_host_lacks_stops_the_engine_with_a_clear_error(tiny_model_path: Path) -> None:
    missing = (os.cpu_count() or 1) + 64
    out = subprocess.run([sys.executable, "-m", "slime_server.rollout.engine_server", "--model-path",
                          str(tiny_model_path), "--port", "1", "--cpus", str(missing)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"error: cannot run on cores {missing}" in out.stderr
