"""A killed trainer's weight buckets leave /dev/shm (``utils/shm.py``): real processes, real torch shared memory.

A process that packs a bucket into a ``SharedArena`` and is then killed together with its children (as Ray
kills a dead worker's, torch's ``torch_shm_manager`` among them) leaves its file in RAM; ``reap_dead_pids``
removes the files of the pids it is given once they are dead, and never those of a live process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from slime_server.utils.procs import kill_group, pid_alive, proc_stat
from slime_server.utils.shm import SHM_ROOT, reap_dead_pids, torch_shm_files

CHILD = textwrap.dedent("""
    import sys, time
    from slime_server.weights import SharedArena
    arena = SharedArena()
    arena.buffer(0, 3 << 20)[:] = 7
    arena.buffer(1, 1 << 20)
    print("ready", flush=True)
    time.sleep(600)
""")


def _start_child() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _files(pid: int) -> list[str]:
    return sorted(torch_shm_files().get(pid, []))


def test_a_killed_ranks_buckets_are_removed_and_a_live_ones_kept() -> None:
    dead, live = _start_child(), _start_child()
    try:
        assert len(_files(dead.pid)) == 2 and len(_files(live.pid)) == 2
        os.killpg(dead.pid, signal.SIGKILL)  # the process and torch's shm manager with it, as Ray does
        dead.wait(30)
        time.sleep(0.5)
        left = _files(dead.pid)
        assert len(left) == 2  # what torch leaves behind: ~4 MB of RAM here, a model's worth in a trainer
        sizes = sum(os.stat(os.path.join(SHM_ROOT, n)).st_size for n in left)
        assert reap_dead_pids([dead.pid, live.pid], wait_s=1.0) == (2, sizes)
        assert _files(dead.pid) == []
        assert len(_files(live.pid)) == 2  # alive: in use, never removed
    finally:
        for p in (dead, live):
            kill_group(p)


def test_reaping_waits_for_a_kill_to_take_effect() -> None:
    """A rank still running when the reaper starts (a kill that lands a second later) is waited for; a killed
    process its parent has not collected yet (a zombie) is dead already: no waiting on the parent."""
    proc = _start_child()
    try:
        assert len(_files(proc.pid)) == 2
        threading.Timer(1.0, os.killpg, (proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        assert reap_dead_pids([proc.pid], wait_s=20.0)[0] == 2 and _files(proc.pid) == []
        assert time.monotonic() - t0 >= 0.9
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    zombie = _start_child()
    try:
        os.killpg(zombie.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc_stat(zombie.pid)[0] != "Z" and time.monotonic() < deadline:  # not collected: we hold it
            time.sleep(0.01)
        assert proc_stat(zombie.pid)[0] == "Z" and not pid_alive(zombie.pid)
        t0 = time.monotonic()
        assert reap_dead_pids([zombie.pid], wait_s=20.0)[0] == 2 and _files(zombie.pid) == []
        assert time.monotonic() - t0 < 5  # os.kill(pid, 0) succeeds on a zombie: that check waited 20 s here
    finally:
        zombie.wait(30)


def test_recorded_ranks_of_a_killed_server_are_reaped_by_the_next_one(tmp_path: Path) -> None:
    """``record_ranks`` markers (``<host>@<pid>``): the next server on the host removes the buckets of recorded
    pids that are dead, and their markers; a live rank and another host's ranks are left alone."""
    import socket

    from slime_server.utils.shm import forget_ranks, reap_recorded, record_ranks

    host = socket.gethostname()
    dead, live = _start_child(), _start_child()
    registry = tmp_path / ".ranks"
    try:
        record_ranks(registry, [(host, dead.pid), (host, live.pid), ("elsewhere", dead.pid)])
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait(30)
        assert len(_files(dead.pid)) == 2
        assert reap_recorded(registry)[0] == 2
        assert _files(dead.pid) == [] and len(_files(live.pid)) == 2
        assert sorted(os.listdir(registry)) == sorted([f"{host}@{live.pid}", f"elsewhere@{dead.pid}"])
        forget_ranks(registry, [(host, live.pid)])  # a clean shutdown forgets its ranks
        assert os.listdir(registry) == [f"elsewhere@{dead.pid}"]
    finally:
        for p in (dead, live):
            kill_group(p)
