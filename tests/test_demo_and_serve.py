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

from slime_server.utils.net import find_free_port
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
    port = find_free_port()
    db = tmp_path / "demo.db"
    proc = _start(["demo", "--no-learn", "--model", "tiny", "--num-engines", "2", "--ray-num-cpus", "2",
                   "--port", str(port),
                   "--db-path", str(db), "--log-dir", str(tmp_path / "logs")])
    tree: dict[int, str] = {}
    try:
        lines = output_lines(proc)
        summary = json.loads(wait_for(lines, "[demo] trajectory:", 240, proc))
        assert summary["segments"] == 1  # tool call + tool result + answer merged into one trajectory
        assert summary["reward"] == 1.0
        assert 0 < summary["trained_tokens"] < summary["tokens"]
        assert summary["weight_versions"] == [0]
        wait_for(lines, "[demo] serving", 30, proc)
        base_url = f"http://127.0.0.1:{port}/v1"
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
    port = find_free_port()
    proc = _start(["serve", "--model", "tiny", "--num-engines", "1", "--ray-num-cpus", "1", "--port", str(port),
                   "--api-key", "sekret", "--db-path", str(tmp_path / "serve.db"), "--log-dir", str(tmp_path)])
    tree: dict[int, str] = {}
    try:
        lines = output_lines(proc)
        base_url = wait_for(lines, "openai_base_url:", 240, proc)
        assert base_url == f"http://127.0.0.1:{port}/v1"
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


def test_train_local_runs_a_job_on_a_server_of_its_own(tiny_model_path: Path, tmp_path: Path) -> None:
    """Issue 20: ``slime-server train CONFIG --local`` needs no server: it starts one for the job (the settings
    tree picks the model), follows the job to its end, says where its files are, exits 0 and leaves no
    process behind; without --local and with no server at the URL it exits 2 naming the way out."""
    import shutil

    example = Path(__file__).resolve().parents[1] / "examples" / "grpo_calculator.yaml"
    model = shutil.copytree(tiny_model_path, tmp_path / "model")  # its path names this test's engines alone
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "SLIME_ENGINE__MODEL": str(model), "SLIME_TRAINER__WORK_DIR": str(tmp_path / "jobs"),
           "SLIME_GATEWAY__DB_PATH": str(tmp_path / "db.sqlite")}
    nobody = f"http://127.0.0.1:{find_free_port()}"
    refused = subprocess.run([str(CLI), "train", str(example), "--url", nobody], capture_output=True, text=True,
                             env=env, timeout=60)
    assert refused.returncode == 2 and f"no server at {nobody}" in refused.stderr and "--local" in refused.stderr
    done = subprocess.run([str(CLI), "train", str(example), "--local", "--max-steps", "2", "--poll-s", "0.5",
                           "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, env=env,
                          timeout=280, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job_id = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("job "))
    assert f"job {job_id} completed: 2 steps" in done.stdout
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")] == ["1", "2"]
    job_dir = tmp_path / "jobs" / job_id
    assert f"job files: {job_dir} (TensorBoard: {job_dir}/tb)" in done.stdout
    assert any((job_dir / "tb").iterdir())  # TensorBoard wrote its event file there
    engine_log = next((tmp_path / "logs").rglob("*.log"))
    assert engine_log.stat().st_size > 0
    assert f"model {model}" in done.stdout
    leftover = subprocess.run(["pgrep", "-f", str(model)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout  # no engine (nor anything else on the model) remains
