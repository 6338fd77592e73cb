"""README's tour, run as written: its serve command, its Python snippet, its curl commands and the claims
around them, against ``slime-server serve`` started from README's own line. Only the port differs (README's
8000 becomes a free one) and ``<id>`` becomes the job's id: a README edit that breaks a reader's first steps
fails here. The same server runs the docs' runnable blocks (tests/_docs_run.py), so a renamed flag or route
breaks the build, not the reader.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import stop_leader
from tests._docs_run import DOCS, run_block, runnable_blocks

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SERVE_DIR: dict[str, Path] = {}  # where the tour's server runs (its store is the CLI's default there)
CLI = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "slime-server"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def block_with(lang: str, needle: str) -> str:
    found = [b for b in blocks(lang) if needle in b]
    assert len(found) == 1, f"README has {len(found)} {lang} blocks with {needle!r}"
    return found[0]


def commands(block: str) -> list[str]:
    """The block's shell commands as bash reads them: a command goes on past a trailing backslash and
    inside single quotes; a comment after two spaces is dropped."""
    out, current = [], ""
    for line in block.splitlines():
        if not current and line.count("'") % 2 == 0:
            line = line.split("  #")[0]
        current += line.rstrip().removesuffix("\\")
        current += "\n" if current.count("'") % 2 else " "
        if current.count("'") % 2 == 0 and not line.rstrip().endswith("\\"):
            if current.strip():
                out.append(current.strip())
            current = ""
    return out


def at_port(text: str, port: int) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("localhost:8000", f"localhost:{port}")


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[int]:
    """``slime-server serve`` from README's line, in a scratch directory (its store and job files land there)."""
    line = next(c for c in commands(block_with("bash", "slime-server serve --model tiny")) if
                c.startswith("slime-server serve --model tiny"))
    port = find_free_port()
    argv = at_port(line, port).replace("--port 8000", f"--port {port}").split()
    assert argv[:2] == ["slime-server", "serve"] and str(port) in argv
    work = tmp_path_factory.mktemp("tour")
    SERVE_DIR["work"] = work
    log = (work / "serve.log").open("w")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "SLIME_GATEWAY__PORT": str(port)}
    proc = subprocess.Popen([str(CLI), *argv[1:]], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=240, interval=1.0, proc=proc)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(f"{e}\n{(work / 'serve.log').read_text()[-3000:]}")
        yield port
    finally:
        stop_leader(proc, timeout=60)
        log.close()


def test_the_first_snippet_then_its_reward_finishes_the_episode(port: int) -> None:
    snippet = block_with("python", 'default_headers={"X-Session-Id": "my-episode-1"}')
    exec(compile(at_port(snippet, port), "README.md", "exec"), {})
    then = re.search(r"# then: POST (\S+) (\{.*?\}); GET (\S+)", snippet)
    assert then, snippet
    base = f"http://127.0.0.1:{port}"
    r = httpx.post(base + then[1], json=json.loads(then[2]), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["finished"] is True  # "A scalar reward is the episode's outcome: it finishes the session"
    r = httpx.get(base + then[3], timeout=30)
    assert r.status_code == 200, r.text
    [traj] = r.json()
    assert len(traj["turns"]) == 1 and traj["reward"] == 1.0
    # "... and a later turn in it gets 409"
    r = httpx.post(f"{base}/v1/chat/completions", headers={"X-Session-Id": "my-episode-1"}, timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "again"}]})
    assert r.status_code == 409, r.text


def test_the_three_apis_snippet_records_both_sessions(port: int) -> None:
    [snippet] = [b.code for b in runnable_blocks() if b.page == "agents.md" and "anthropic.Anthropic(" in b.code]
    exec(compile(at_port(snippet, port), "docs/agents.md", "exec"), {})
    for sid in ("ep-1", "ep-2"):
        r = httpx.get(f"http://127.0.0.1:{port}/v1/sessions/{sid}/trajectory", timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()) == 1 and len(r.json()[0]["turns"]) == 1


def test_the_job_commands_and_the_waiting_claim(port: int) -> None:
    block = block_with("bash", "curl -X POST localhost:8000/jobs")
    cmds = [at_port(c, port) for c in commands(block)]
    created = subprocess.run(cmds[0], shell=True, capture_output=True, text=True, timeout=120, check=True)
    job = json.loads(created.stdout)
    assert job["status"] in ("queued", "running"), job
    job_id = job["id"]
    run = {c.split()[-1].rsplit("/", 1)[-1] if "/jobs/<id>/" in c else c.split()[1]: c.replace("<id>", job_id)
           for c in cmds[1:]}
    metrics = subprocess.run(run["metrics"], shell=True, capture_output=True, text=True, timeout=60, check=True)
    assert isinstance(json.loads(metrics.stdout), dict | list), metrics.stdout
    base = f"http://127.0.0.1:{port}"
    # README: "While it cannot train, GET /jobs/<id> says why in waiting": the tour's sessions have no group
    deadline = time.monotonic() + 240
    while not (view := httpx.get(f"{base}/jobs/{job_id}", timeout=30).json()).get("waiting"):
        assert view["status"] in ("queued", "running"), view
        assert time.monotonic() < deadline, view
        time.sleep(1)
    assert view["waiting"].startswith("waiting for complete groups of 4"), view
    paused = subprocess.run(run["pause"], shell=True, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(paused.stdout)["status"] == "paused", paused.stdout
    listed = subprocess.run([str(CLI), "jobs", "list"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SLIME_GATEWAY__PORT": str(port)})
    assert listed.returncode == 0 and job_id in listed.stdout, listed.stdout + listed.stderr
    cancelled = httpx.post(f"{base}/jobs/{job_id}/cancel", timeout=120)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text


def test_the_docs_runnable_blocks_run(port: int) -> None:
    blocks = runnable_blocks()
    assert {b.page for b in blocks} >= {"index.md", "agents.md", "environments.md", "operating.md"}, blocks
    for block in blocks:
        done = run_block(block, port, SERVE_DIR["work"])
        assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_a_renamed_flag_in_the_docs_fails_the_run(port: int) -> None:
    """The planted mistake: the docs' export block with its ``--format`` flag misspelt must fail."""
    [export] = [b for b in runnable_blocks() if "slime-server export --format" in b.code]
    planted = type(export)(export.page, export.lang, export.code.replace("--format", "--fromat"))
    done = run_block(planted, port, SERVE_DIR["work"])
    assert done.returncode != 0 and "--fromat" in done.stderr, done.stderr[-2000:]
    assert (DOCS / export.page).read_text().count("--fromat") == 0  # planted in the copy only

