"""serve's default placement on a CPU host (server/core_share.py): the engines get all of the host's cores while
no job trains and the lower half while one does (its ranks the upper half), and the CPU engine's torch threads
follow its cores. Checked on the processes: every thread's affinity from /proc, the engine's thread count
from its server info (what torch runs with), before, during and after a real job.

The rest of the suite runs with one thread per engine and rank anywhere (tests/conftest.py: three workers share
two cores); this module takes those settings away again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime_server.config import EngineSettings, TrainerSettings
from slime_server.server.core_share import CoreShare
from slime_server.server.launch import rank_registry
from slime_server.utils.affinity import host_cores, slices
from tests._engine_helpers import thread_affinities
from tests._jobs_helpers import admin, running_stack, wait_job

pytestmark = pytest.mark.timeout(400)


def test_the_default_split() -> None:
    auto = dict(engine=EngineSettings(), trainer=TrainerSettings(), local=True)
    two = CoreShare(**auto, cores=[0, 1])
    assert two.engine_cores(1) == [[0, 1]] and two.engine_cores(2) == [[0], [1]]
    two.training = 1
    assert two.trainer_cores() == [1] and two.trainer_threads() == 1 and two.engine_cores(1) == [[0]]
    eight = CoreShare(**auto, cores=list(range(8)))
    assert eight.engine_cores(3) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    eight.training = 2  # two jobs train: their ranks share the upper half
    assert eight.trainer_cores() == [4, 5, 6, 7] and eight.engine_cores(2) == [[0, 1], [2, 3]]
    one = CoreShare(**auto, cores=[3])
    one.training = 1
    assert one.trainer_cores() == [3] and one.engine_cores(2) == [[3], [3]]  # nothing to split: they share it
    ranks = CoreShare(engine=EngineSettings(), trainer=TrainerSettings(num_ranks=2), local=True, cores=list(range(8)))
    assert ranks.trainer_threads() == 2


def test_settings_made_by_hand_are_kept() -> None:
    cores = list(range(4))
    by_hand = CoreShare(engine=EngineSettings(torch_threads=1), trainer=TrainerSettings(cpus="2-3"), local=True,
                        cores=cores)
    by_hand.training = 1
    assert by_hand.engine_cores(1) is None and by_hand.trainer_cores() == [2, 3] and by_hand.trainer_threads() is None
    engines_auto = CoreShare(engine=EngineSettings(), trainer=TrainerSettings(cpus="3"), local=True, cores=cores)
    engines_auto.training = 1
    assert engines_auto.engine_cores(1) == [[0, 1, 2]]  # off the ranks' cores, as given
    threads_only = CoreShare(engine=EngineSettings(), trainer=TrainerSettings(torch_threads=2), local=True,
                             cores=cores)
    threads_only.training = 1
    assert threads_only.trainer_cores() is None and threads_only.engine_cores(1) == [[0, 1, 2, 3]]
    for remote in (CoreShare(**dict(engine=EngineSettings(), trainer=TrainerSettings()), local=False, cores=cores),
                   CoreShare(engine=EngineSettings(kind="sglang"), trainer=TrainerSettings(colocate=True),
                             local=True, cores=cores)):
        remote.training = 1
        assert remote.engine_cores(1) is None and remote.trainer_cores() is None


def _engine_info(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]


def _generate(url: str) -> None:
    r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text


def _wait(check, what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _affinities(pid: int) -> set[frozenset[int]]:
    return set(map(frozenset, thread_affinities(pid).values()))


def test_serve_gives_the_engine_every_core_then_half_while_a_job_trains(tiny_model_path: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    monkeypatch.delenv("SLIME_ENGINE__TORCH_THREADS", raising=False)
    monkeypatch.delenv("SLIME_TRAINER__TORCH_THREADS", raising=False)
    cores = host_cores()
    half = max(1, len(cores) // 2) if len(cores) > 1 else 0
    trainer_cores = cores[len(cores) - half:] if half else cores
    engine_cores = cores[:len(cores) - half] if half else cores
    assert slices(engine_cores, 1) == [engine_cores]
    with running_stack(tiny_model_path, tmp_path, keys=True) as server:
        dep = server.deployment
        (status,) = dep.engine_status()
        url = status.url
        assert _affinities(status.pid) == {frozenset(cores)}
        _generate(url)
        info = _engine_info(url)
        assert (info["torch_threads"], info["cpus"]) == (len(cores), cores)

        spec = {"name": "cores", "algorithm": "grpo", "optimizer": {"lr": 1e-3},
                "data": {"source": "dataset", "environment": "calculator", "num_prompts": 64, "concurrency": 4,
                         "max_tokens": 24},
                "loop": {"batch_size": 4, "n_samples_per_prompt": 2, "max_staleness": None, "poll_interval_s": 0.05,
                         "checkpoint_interval": 100, "max_steps": 3},
                # the smallest buffer a dataset job takes: no episodes nobody trains on while the ranks start
                "pacing": {"max_buffered": 8, "retry_after_s": 0.25}}
        with admin(server) as c:
            r = c.post("/jobs", json=spec)
            assert r.status_code == 200, r.text
            job_id = r.json()["id"]
        # while its ranks run: the engine on the lower half (every thread), torch's pool resized to it
        _wait(lambda: _affinities(status.pid) == {frozenset(engine_cores)}, "the engine to move off the ranks' cores")
        registry = rank_registry(dep.settings.trainer)
        rank_pids = _wait(lambda: [int(m.name.rpartition("@")[2]) for m in registry.glob("*@*")],
                          "the job's ranks to start")
        _wait(lambda: all(_affinities(p) == {frozenset(trainer_cores)} for p in rank_pids), "the ranks' cores")
        _wait(lambda: _engine_info(url)["torch_threads"] == len(engine_cores), "the engine's threads to follow")
        assert _engine_info(url)["cpus"] == engine_cores

        wait_job(server, job_id, lambda j: j["status"] == "completed", timeout=300)
        # the ranks are gone: every core back to the engine, and its threads with its next step
        _wait(lambda: _affinities(status.pid) == {frozenset(cores)}, "the engine to get its cores back")
        _generate(url)
        info = _engine_info(url)
        assert (info["torch_threads"], info["cpus"]) == (len(cores), cores)
