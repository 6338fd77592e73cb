"""The slime-server command line as tests drive it: its path, its output lines, waiting for one."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from pathlib import Path

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
