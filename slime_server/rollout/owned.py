"""Child servers that cannot outlive their owner.

Engines and the router run in their own process group (so shutdown can kill a server and its
children at once), which also means nothing kills them if the owner dies abruptly (SIGKILL, OOM,
``ray.kill``). On Linux ``PR_SET_PDEATHSIG`` closes that hole: the kernel SIGKILLs the child when
its parent goes. The signal actually fires when the parent *thread* that forked exits, so every fork
goes through one long-lived spawner thread instead of the caller's (possibly short-lived) thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_spawner = ThreadPoolExecutor(1, thread_name_prefix="owned-spawner")  # lives as long as the process


def _die_with_parent() -> None:
    """Runs in the child between fork and exec."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux/glibc: fall back to explicit shutdown only
        pass


def spawn_owned(cmd: Sequence[str], env: Mapping[str, str] | None = None,
                log_path: str | Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new process group, output appended to ``log_path`` (or inherited)."""
    full_env = {**os.environ, **(env or {})}
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - the child owns it
    try:
        return _spawner.submit(
            subprocess.Popen, list(cmd), env=full_env, stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True, preexec_fn=_die_with_parent,
        ).result()
    finally:
        if out is not None:
            out.close()


START_ATTEMPTS = 3


def start_retrying(launch: Callable[[], None], wait_ready: Callable[[], None], kill: Callable[[], None],
                   again: Callable[[], bool], attempts: int = START_ATTEMPTS) -> None:
    """Start a server whose port can be taken between choosing it and binding it: ``launch`` it, ``wait_ready``;
    when it exits before it is ready (``RuntimeError``), ``kill`` what is left and, if ``again()`` says so (it
    picks fresh ports), launch once more, ``attempts`` times at most. A start that times out is not retried.

    Why shared: the engines and the router both choose free ports while Ray workers, other engines and other
    routers start beside them; each decides in ``again`` which exits are worth another port."""
    for attempt in range(attempts):
        launch()
        try:
            wait_ready()
            return
        except RuntimeError:  # exited before it was ready
            kill()
            if attempt == attempts - 1 or not again():
                raise
        except TimeoutError:
            kill()
            raise
