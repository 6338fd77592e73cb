"""Two test hosts on one machine: network namespaces joined by a veth pair (made for a test, removed after).

Needs root (CI runs the suite as root); without it the test fails rather than skips."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in r.stdout.split()]


def kill_namespace_processes(ns: str, grace_s: float = 10.0) -> None:
    """Everything still running in ``ns`` (a Ray node leaves workers behind): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in netns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while netns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.2)


@contextlib.contextmanager
def two_namespaces(net: str) -> Iterator[tuple[str, str]]:
    """Namespaces A (``net``.1) and B (``net``.2) joined by veth; their processes killed and both removed after."""
    tag = f"{os.getpid() % 100000}"
    a, b = f"slime-a{tag}", f"slime-b{tag}"
    try:
        ip("netns", "add", a)
    except subprocess.CalledProcessError as e:  # not root / no CAP_SYS_ADMIN: this test cannot run here
        pytest.fail(f"cannot create a network namespace (run the suite as root, as CI does): {e.stderr}")
    try:
        ip("netns", "add", b)
        ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, host in ((a, f"va{tag}", 1), (b, f"vb{tag}", 2)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{net}.{host}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            kill_namespace_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
