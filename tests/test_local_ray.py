"""A server's own Ray cluster (server/local_ray.py) runs without a log monitor or autoscaler monitor, and a worker a
task used exits once idle, while an actor's stays; a job runs on it as on any (every live-job test does)."""

from __future__ import annotations

import json
import subprocess
import sys

# a fresh interpreter: the cluster is started by the server's own start-up (launch._init_ray), then described
SCRIPT = r"""
import json, os, time
import psutil, ray
from slime_server.config import ServerSettings
from slime_server.server import launch

assert launch._init_ray(ServerSettings.model_validate({"ray": {"num_cpus": 2}}))

@ray.remote(num_cpus=0)
def pid():
    return os.getpid()

@ray.remote(num_cpus=1)
class Actor:
    def pid(self):
        return os.getpid()

actor = Actor.remote()
actor_pid, task_pid = ray.get(actor.pid.remote()), ray.get(pid.remote())
deadline = time.monotonic() + 30
while psutil.pid_exists(task_pid) and time.monotonic() < deadline:
    time.sleep(0.2)
procs = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
print(json.dumps({"procs": procs, "task_worker_alive": psutil.pid_exists(task_pid),
                  "actor_alive": psutil.pid_exists(actor_pid), "answered": ray.get(actor.pid.remote()) == actor_pid}))
ray.shutdown()
"""


def test_a_servers_own_ray_runs_lean() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    procs = seen["procs"]
    assert any("gcs_server" in p for p in procs) and any("raylet" in p for p in procs), procs
    assert not any("log_monitor.py" in p for p in procs), procs
    assert not any("autoscaler/_private/monitor.py" in p for p in procs), procs
    assert not seen["task_worker_alive"]  # the task's worker exited once idle (num_workers_soft_limit 0)
    assert seen["actor_alive"] and seen["answered"]
