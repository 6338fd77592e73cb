"""`slime-server demo` and `slime-server serve` as real subprocesses: the OpenAI SDK gets answers from
the gateway over engines behind the real sgl-router, the demo's episode is recorded token-exactly,
and SIGTERM leaves no engine, router, Ray or gateway process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from slime_server.utils.procs import kill_group
from tests._cli_helpers import CLI, output_lines, wait_for
from tests._rollout_helpers import pid_alive, proc_tree

pytestmark = pytest.mark.timeout(300)


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(CLI), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def _stop_and_check_no_orphans(proc: subprocess.Popen, tree: dict[int, str], lines) -> list[str]:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    time.sleep(0.2)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(pid_alive(p, st) for p, st in tree.items()):
        time.sleep(0.2)
    assert [p for p, st in tree.items() if pid_alive(p, st)] == []
    return rest


def _chat(base_url: str, api_key: str = "none") -> str:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens >= 1
    return r.choices[0].finish_reason


def test_demo_records_an_episode_then_serves_until_sigterm(tiny_model_path: Path, tmp_path: Path) -> None:
    assert tiny_model_path.exists()
    db = tmp_path / "demo.db"
    # no --port: the gateway binds a free one itself and says which (a port chosen here first could be taken by
    # another worker's process before the CLI binds it: CI saw "Address already in use")
    proc = _start(["demo", "--no-learn", "--model", "tiny", "--num-engines", "2", "--ray-num-cpus", "2",
                   "--db-path", str(db), "--log-dir", str(tmp_path / "logs")])
    tree: dict[int, str] = {}
    try:
        lines = output_lines(proc)
        base_url = wait_for(lines, "[demo] up in", 240, proc).split("openai_base_url: ")[1].split()[0]
        port = int(base_url.removesuffix("/v1").rsplit(":", 1)[1])
        summary = json.loads(wait_for(lines, "[demo] trajectory:", 240, proc))
        assert summary["segments"] == 1  # tool call + tool result + answer merged into one trajectory
        assert summary["reward"] == 1.0
        assert 0 < summary["trained_tokens"] < summary["tokens"]
        assert summary["weight_versions"] == [0]
        wait_for(lines, "[demo] serving", 30, proc)
        assert _chat(base_url) in ("stop", "length")
        tree = proc_tree(proc.pid)
        rest = _stop_and_check_no_orphans(proc, tree, lines)
        assert "[demo] stopped" in rest
    finally:
        kill_group(proc)
    assert db.exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)


def test_serve_with_api_key(tiny_model_path: Path, tmp_path: Path) -> None:
    assert tiny_model_path.exists()
    proc = _start(["serve", "--model", "tiny", "--num-engines", "1", "--ray-num-cpus", "1", "--port", "0",
                   "--api-key", "sekret", "--db-path", str(tmp_path / "serve.db"), "--log-dir", str(tmp_path)])
    tree: dict[int, str] = {}
    try:
        lines = output_lines(proc)
        base_url = wait_for(lines, "openai_base_url:", 240, proc)
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")  # the port it bound
        deadline = time.monotonic() + 30
        while True:  # uvicorn binds just after the line is printed
            try:
                r = httpx.get(f"{base_url}/models", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 401 and r.json()["error"]["type"]
        models = httpx.get(f"{base_url}/models", headers={"Authorization": "Bearer sekret"}, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]  # a built-in or registry model keeps its short name
        assert _chat(base_url, api_key="sekret") in ("stop", "length")
        tree = proc_tree(proc.pid)
        rest = _stop_and_check_no_orphans(proc, tree, lines)
        assert "stopped" in rest
    finally:
        kill_group(proc)
