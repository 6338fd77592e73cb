"""The whole server killed with ``kill -9`` mid-job (issue 9, "Faults"): on restart every turn and
reward it acknowledged is in the store, and the job resumes from its last checkpoint.

`slime-server serve` runs as a real subprocess in its own process group (engines, router, Ray,
trainer ranks, gateway); SIGKILL to the group is the crash. Nothing is flushed on the way down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from _rollout_helpers import pid_alive, proc_tree
from test_cli_engines import CLI, _lines, _wait_for
from test_jobs_e2e import ADMIN, AGENT, create_job, drive, wait_event, wait_job

from slime_server.utils.net import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _serve(model: Path, work: Path, port: int) -> tuple[subprocess.Popen, SimpleNamespace]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [str(CLI), "serve", "--model", str(model), "--num-engines", "1", "--ray-num-cpus", "3", "--port", str(port),
         "--api-key", AGENT, "--admin-api-key", ADMIN, "--db-path", str(work / "db.sqlite"),
         "--trainer-work-dir", str(work / "jobs"), "--log-dir", str(work / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    base_url = _wait_for(_lines(proc), "openai_base_url:", 240, proc)
    deadline = time.monotonic() + 30
    while True:  # uvicorn binds just after the line is printed
        try:
            httpx.get(f"{base_url}/models", timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    return proc, SimpleNamespace(base_url=base_url, deployment=SimpleNamespace(model_path=str(model)))


def _kill_group(proc: subprocess.Popen) -> None:
    tree = proc_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for pid, start in tree.items():  # Ray daemons leave the group: a crash takes them down too
        if pid_alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_server_kill_9_loses_nothing_and_the_job_resumes(tiny_model_path: Path, tmp_path: Path) -> None:
    port = find_free_port()
    proc, server = _serve(tiny_model_path, tmp_path, port)
    try:
        j = create_job(server, batch_size=4, checkpoint_interval=2, max_staleness=None)
        wait_event(server, j["id"], "trainer_ready")
        acknowledged = drive(server, 12)  # each returned only after its turn, reward and close were answered
        j = wait_job(server, j["id"], lambda x: x["step"] >= 3)
        assert j["checkpoints"][-1]["step"] == 2
    finally:
        _kill_group(proc)

    proc, server = _serve(tiny_model_path, tmp_path, port)
    try:
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as c:
            for sid in acknowledged:
                info = c.get(f"/sessions/{sid}").raise_for_status().json()
                view = c.get(f"/sessions/{sid}/trajectory").raise_for_status().json()
                assert info["status"] == "closed" and info["num_turns"] == 1
                assert len(view) == 1 and view[0]["reward"] is not None and sum(view[0]["loss_mask"]) > 0
        resumed = wait_event(server, j["id"], "resumed")["data"]
        assert resumed["from_step"] == 2
        acknowledged += drive(server, 4)
        done = wait_job(server, j["id"], lambda x: x["step"] >= 4 and x["status"] == "running")
        assert done["policy_version"] > j["policy_version"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
