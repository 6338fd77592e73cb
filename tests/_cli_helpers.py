"""The slime-server command line as tests drive it: its path, its output lines, waiting for one."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from pathlib import Path

CLI = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "slime-server"


def output_lines(proc: subprocess.Popen) -> queue.Queue[str]:
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return q


def wait_for(q: queue.Queue[str], prefix: str, timeout: float, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, f"CLI exited early with {proc.returncode}"
            continue
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise TimeoutError(f"no {prefix!r} line within {timeout}s")
