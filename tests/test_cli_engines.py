"""`slime-server engines` as a real subprocess: serves through the router, exits 0 on SIGTERM / Ctrl-C,
and leaves no engine, router or Ray process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from slime_server.utils.procs import kill_group
from tests._cli_helpers import CLI, output_lines, wait_for
from tests._rollout_helpers import generate_body, pid_alive, proc_tree

pytestmark = pytest.mark.timeout(300)

@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_engines_command_serves_then_exits_clean(how: str, tiny_model_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("slime_server.rollout.engine_server", reason="the CPU engine is not in this tree yet")
    assert tiny_model_path.exists()  # builds the cached tiny model the CLI's "--model tiny" resolves to
    # RAY_ADDRESS naming no cluster (as a stale /tmp/ray/ray_current_cluster would): with no ray.address the
    # command starts a Ray of its own instead of trying to join it
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "RAY_ADDRESS": "127.0.0.1:9"}
    proc = subprocess.Popen(
        [str(CLI), "engines", "--model", "tiny", "--num-engines", "2", "--ray-num-cpus", "2",
         "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    tree: dict[int, str] = {}
    try:
        lines = output_lines(proc)
        router_url = wait_for(lines, "router_url:", 180, proc)
        engine_urls = [wait_for(lines, "engine_url:", 10, proc) for _ in range(2)]
        assert len(set(engine_urls)) == 2 and router_url not in engine_urls

        r = httpx.post(f"{router_url}/generate", json=generate_body(), timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 4

        tree = proc_tree(proc.pid)
        cmdlines = " ".join(Path(f"/proc/{p}/cmdline").read_text() for p in tree if pid_alive(p))
        # the router: our launcher's command line until the Rust router renames its process "sglang::router"
        assert any(n in cmdlines for n in ("sglang::router", "slime_server.rollout.router_launch"))
        assert cmdlines.count("slime_server.rollout.engine_server") == 2
        assert "raylet" in cmdlines

        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:  # a terminal's Ctrl-C reaches the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        time.sleep(0.2)  # let the reader thread drain the pipe
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        assert "stopped" in rest
    finally:
        kill_group(proc)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(pid_alive(p, st) for p, st in tree.items()):
        time.sleep(0.2)
    assert [p for p, st in tree.items() if pid_alive(p, st)] == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{router_url}/health", timeout=2)


def test_unknown_flag_is_a_usage_error() -> None:
    r = subprocess.run([str(CLI), "engines", "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--no-such-flag" in r.stderr


def test_gateway_command_refuses_an_open_bind_without_an_admin_key(tmp_path: Path) -> None:
    """The gateway alone follows the same rule as ``serve``: beyond loopback only with an admin key."""
    cmd = [str(CLI), "gateway", "--router-url", "http://127.0.0.1:9", "--model-path", str(tmp_path),
           "--db-path", str(tmp_path / "db.sqlite"), "--host", "0.0.0.0", "--api-key", "agent-only"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and "admin" in r.stderr and "--insecure-gateway" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "db.sqlite").exists()  # refused before anything opened
