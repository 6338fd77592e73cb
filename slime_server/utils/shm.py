"""Removing the torch shared-memory files (``/dev/shm/torch_<pid>_*``) that a dead trainer rank left behind.

Why: a rank packs each weight push into reusable shared-memory buckets (``weights.SharedArena``), about one
model of RAM. On a clean shutdown the rank frees them and torch unlinks the files. When the rank is killed
(a crash, ``kill -9``, the job manager replacing a dead group, ``ray.kill`` at shutdown) torch's
``torch_shm_manager`` would unlink them, but Ray kills a dead worker's child processes too, the manager
included, and the files stay in RAM until the machine reboots: one model per killed rank. Only the files of
pids this process knows were its ranks, and only once those pids are gone, are removed: a file whose process is
alive is in use, and other users' files are not ours."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path

from slime_server.utils.procs import pid_alive

SHM_ROOT = "/dev/shm"
_TORCH_SHM = re.compile(r"^torch_(\d+)_")


def torch_shm_files(root: str = SHM_ROOT) -> dict[int, list[str]]:
    """The torch shared-memory files under ``root``, by the pid that created them."""
    out: dict[int, list[str]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        m = _TORCH_SHM.match(name)
        if m is not None:
            out.setdefault(int(m.group(1)), []).append(name)
    return out


def _unlink(root: str, names: Iterable[str]) -> tuple[int, int]:
    removed = freed = 0
    for name in names:
        path = os.path.join(root, name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            continue
        removed, freed = removed + 1, freed + size
    return removed, freed


def reap_dead_pids(pids: Iterable[int], wait_s: float = 0.0, root: str = SHM_ROOT) -> tuple[int, int]:
    """Remove the torch shared-memory files of those of ``pids`` that are dead, waiting up to ``wait_s`` for
    them to die (a kill is asynchronous); (files, bytes) removed. A pid still alive after the wait is left."""
    pending = set(pids)
    deadline = time.monotonic() + wait_s
    while any(pid_alive(p) for p in pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    files = torch_shm_files(root)
    return _unlink(root, [n for p in pending if not pid_alive(p) for n in files.get(p, [])])


def reap_own(root: str = SHM_ROOT) -> tuple[int, int]:
    """Remove this process's own torch shared-memory files; (files, bytes). For a trainer rank that let go of every
    shared tensor and lives on, kept for another job (``trainer/warm_ranks.py``): an engine that copied from its
    parameters may still map them, which keeps torch from unlinking them, and no dead pid would ever name them.
    Unlinking a name leaves every mapping of it valid; the pages go with the last one."""
    return _unlink(root, torch_shm_files(root).get(os.getpid(), []))


def reap_all_dead(root: str = SHM_ROOT) -> tuple[int, int]:
    """Remove every torch shared-memory file whose creating process is gone (a machine of one's own only,
    such as the test suite's: it cannot tell whose files they were)."""
    files = torch_shm_files(root)
    return _unlink(root, [n for pid, names in files.items() if not pid_alive(pid) for n in names])


# ---------------------------------------------------------------- ranks that died with their server

def _marker(host: str, pid: int) -> str:
    return f"{host}@{pid}"


def record_ranks(registry: Path, ranks: Iterable[tuple[str, int]]) -> None:
    """One marker file per rank process (``<host>@<pid>``) under ``registry`` while it runs. Why: a server
    killed with ``kill -9`` never shuts its ranks down, Ray kills them, and their buckets stay in /dev/shm;
    the next server on that host (``reap_recorded``) can tell those files apart from anyone else's."""
    registry.mkdir(parents=True, exist_ok=True)
    for host, pid in ranks:
        (registry / _marker(host, pid)).touch()


def forget_ranks(registry: Path, ranks: Iterable[tuple[str, int]]) -> None:
    for host, pid in ranks:
        (registry / _marker(host, pid)).unlink(missing_ok=True)


def reap_recorded(registry: Path, host: str | None = None, root: str = SHM_ROOT) -> tuple[int, int]:
    """Remove the buckets of the recorded ranks on this host whose process is gone, and their markers; a rank
    still alive keeps both; (files, bytes) removed."""
    host = host or socket.gethostname()
    removed = freed = 0
    try:
        markers = [m for m in os.listdir(registry) if m.rpartition("@")[0] == host]
    except OSError:
        return 0, 0
    for m in markers:
        pid_text = m.rpartition("@")[2]
        if not pid_text.isdigit() or pid_alive(int(pid_text)):
            continue
        n, b = reap_dead_pids([int(pid_text)], root=root)
        removed, freed = removed + n, freed + b
        (registry / m).unlink(missing_ok=True)
    return removed, freed
