"""Child-process management: every server we spawn lives in its own process group so
that shutdown (Ctrl-C, SIGTERM, test teardown) can kill it and all its children; and
``run_until_signal``, the main thread's wait of every long-running command; ``name_os_thread``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any


def spawn(cmd: Sequence[str], env: dict[str, str] | None = None, log_path: str | None = None,
          cwd: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session (process group); output to ``log_path`` or inherited."""
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the child
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        list(cmd), env=full_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT if out else None,
        start_new_session=True,
    )


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after "pid (comm)" (state is [0], ppid [1], start time [19]), or None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rindex(")") + 2:].split()


def pid_alive(pid: int, start_time: str | None = None) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped by its parent) counts as gone: waiting for a
    killed process to be reaped would wait on its parent. ``start_time`` (field [19] of its stat) guards against
    the pid's reuse by a later process. Without ``/proc`` (not Linux) a signal 0 decides."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process
            return True
        return True
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return start_time is None or st[19] == start_time


def python_module_cmd(module: str, *args: str) -> list[str]:
    """Command line running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def kill_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group, wait, then SIGKILL whatever is left."""
    if proc.poll() is not None:
        _kill_pg(proc.pid, signal.SIGKILL)  # reap stragglers of an exited leader
        return
    _kill_pg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    _kill_pg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def stop_leader(proc: subprocess.Popen, timeout: float = 90.0) -> None:
    """SIGTERM the group's leader only (its own shutdown stops what it started, as ``serve`` does), wait, then
    SIGKILL the whole group: whatever the leader left behind, or all of it if the leader hung."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc, timeout=10.0)


def _kill_pg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def cli_flags(args: Mapping[str, Any]) -> list[str]:
    """``{"queue_size": 8, "disable_retries": True, "y": [1, 2]}`` -> ``--queue-size 8 --disable-retries --y 1 2``.

    True is a bare switch, False/None drop the flag, lists become several values after one flag. A value
    that starts with ``-`` (a key, a negative number) is joined to its flag (``--api-key=-x``): argparse
    would read it as another option otherwise.
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        elif str(value).startswith("-"):
            out.append(f"{flag}={value}")
        else:
            out += [flag, str(value)]
    return out


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM so startup and waiting unwind through finally."""


def run_until_signal(start: Any, stop: Any) -> int:
    """Run ``start()``; block until SIGINT/SIGTERM; then ``stop(obj)`` exactly once. Returns 0."""
    fired = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if not fired.is_set():
            fired.set()
            raise _Stop(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    obj = None
    try:
        obj = start()
        while not fired.wait(3600):
            pass
    except _Stop:
        pass
    finally:
        for s in old:  # a second Ctrl-C must not interrupt cleanup
            signal.signal(s, signal.SIG_IGN)
        if obj is not None:
            stop(obj)
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def name_os_thread(name: str) -> None:
    """Give the calling thread this OS name (Linux, first 15 bytes; elsewhere nothing): ``top -H``, ``ps -L``
    and /proc show it, and threads it starts (OpenMP's workers) inherit it."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME

