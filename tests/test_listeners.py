"""A server's readiness is its own: a URL answered by another process that took the port (CI: an engine's
/health answered by another test's server while the engine died of "address already in use") is not ready.
Real processes on real ports; Linux's /proc says who listens."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from slime_server.utils.listeners import owns_listener
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture
def stranger() -> Iterator[tuple[subprocess.Popen, int]]:
    """An HTTP server on a port: the process that took it first."""
    port = find_free_port()
    proc = _start([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"])
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/", timeout=30, proc=proc)
        yield proc, port
    finally:
        kill_group(proc)


def test_an_answer_from_another_process_is_not_ready(stranger: tuple[subprocess.Popen, int]) -> None:
    server, port = stranger
    ours = _start([sys.executable, "-c", "import time; time.sleep(60)"])  # still loading, not yet bound
    try:
        assert owns_listener(server.pid, port) is True
        assert owns_listener(ours.pid, port) is False
        with pytest.raises(TimeoutError, match=f"from a process other than pid {ours.pid}"):
            wait_http_ok(f"http://127.0.0.1:{port}/", timeout=1.5, proc=ours)
        wait_http_ok(f"http://127.0.0.1:{port}/", timeout=5, proc=server)  # its own answer is ready
        wait_http_ok(f"http://127.0.0.1:{port}/", timeout=5)  # without a process nothing is checked
    finally:
        kill_group(ours)


def test_a_server_forked_in_the_launched_session_counts_as_its_own() -> None:
    port = find_free_port()
    shell = _start(["sh", "-c", f"{sys.executable} -m http.server {port} --bind 127.0.0.1 & wait"])
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/", timeout=30, proc=shell)
        assert owns_listener(shell.pid, port) is True
    finally:
        kill_group(shell)
