"""Run untrusted, model-written Python in a subprocess with time, memory, network and file limits.

Layers (each one alone is not a security boundary; together they keep a training run safe from
what a policy writes by accident or by reward hacking):
- its own process group, killed (SIGKILL) at the wall-clock limit; CPU-seconds and address-space
  rlimits; output truncated;
- a fresh, empty temporary directory as cwd and HOME; environment variables cleared;
- a Python audit hook installed before the code runs (it cannot be removed from Python) that
  refuses sockets, subprocesses, ``os.system``/``exec*``/``fork`` and any file opened for writing
  outside the temporary directory;
- where the kernel allows it (root or user namespaces), a new, empty network namespace.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

_PRELUDE = r'''
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_BLOCK = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty",
          "pty.spawn", "ctypes.dlopen", "os.kill", "os.killpg")
_WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                 "os.symlink", "os.truncate", "shutil.rmtree", "os.utime")
def _inside(path):
    try:
        p = os.path.realpath(os.fspath(path))
    except TypeError:
        return True  # file descriptors: already open
    return p == _ROOT or p.startswith(_ROOT + os.sep)
def _hook(event, args):
    if event.startswith(_BLOCK):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        writing = isinstance(mode, str) and any(c in mode for c in "wax+")
        writing = writing or (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND))
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
    elif event in _WRITE_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed")
sys.addaudithook(_hook)
del _hook
_code = open("main.py").read()
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
'''


class SandboxResult(BaseModel):
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _limits(memory_bytes: int, cpu_seconds: int, isolate_network: bool) -> None:
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    if isolate_network:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.unshare(0x40000000)  # CLONE_NEWNET; fails quietly without privileges (the hook still blocks)
        except Exception:  # noqa: BLE001
            pass


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 4000,
               isolate_network: bool = True) -> SandboxResult:
    """Run ``code`` as a script in a fresh temp dir; never raises for what the code does."""
    with tempfile.TemporaryDirectory(prefix="slime-sandbox-") as tmp:
        Path(tmp, "main.py").write_text(code, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _PRELUDE], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=lambda: _limits(memory_mb << 20, max(1, int(timeout_s) + 1), isolate_network))
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        return SandboxResult(returncode=None if timed_out else proc.returncode,
                             stdout=out.decode("utf-8", "replace")[:max_output],
                             stderr=err.decode("utf-8", "replace")[-max_output:], timed_out=timed_out,
                             seconds=time.monotonic() - t0)
