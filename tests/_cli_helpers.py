"""The slime-server command line as tests drive it: its path, its output lines, waiting for one."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from slime_server.utils.procs import kill_group

CLI = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "slime-server"


class Lines(queue.Queue):
    """A command's output lines as they come; ``seen`` keeps every one (what a failure prints)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.ended = threading.Event()


def output_lines(proc: subprocess.Popen) -> Lines:
    q = Lines()

    def pump() -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                q.seen.append(line.rstrip("\n"))
                q.put(line.rstrip("\n"))
        finally:
            q.ended.set()

    threading.Thread(target=pump, daemon=True).start()
    return q


def command_output(q: queue.Queue[str], last: int = 80) -> str:
    """The command's output so far (its last ``last`` lines), for a failure's message."""
    seen = getattr(q, "seen", None)
    if seen is None:
        return "(output not kept)"
    return "\n".join(["--- the command's output" + (f" (last {last} lines)" if len(seen) > last else "") + " ---",
                      *seen[-last:], "--- end ---"])


def wait_for(q: queue.Queue[str], prefix: str, timeout: float, proc: subprocess.Popen) -> str:
    """The rest of the first line starting with ``prefix``. A command that exits first, or a line that does not
    come in ``timeout`` s, fails with the command's own output in the message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                ended = getattr(q, "ended", None)
                if ended is not None:
                    ended.wait(10)  # its last lines (the error) are read before we report it
                raise AssertionError(f"CLI exited early with {proc.returncode} before {prefix!r}\n"
                                     + command_output(q)) from None
            continue
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise TimeoutError(f"no {prefix!r} line within {timeout}s\n" + command_output(q))


def run_demo(args: list[str], timeout: float) -> dict[str, Any]:
    """``slime-server demo ARGS`` to its end as a reader runs it (its own process group, killed on the way out):
    its last output printed, exit 0 asserted, and its ``[demo] summary`` line parsed."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(CLI), "demo", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    sys.stdout.write(out[-3000:])
    assert proc.returncode == 0
    return json.loads(next(line for line in out.splitlines() if line.startswith("[demo] summary: "))
                      .removeprefix("[demo] summary: "))

