"""Acceptance (issue 21): real agent harnesses train here. Claude Code (npm ``@anthropic-ai/claude-code``,
``ANTHROPIC_BASE_URL`` pointing at the gateway) speaks Anthropic Messages; Codex CLI (npm
``@openai/codex``, a custom provider with ``wire_api = "responses"``) speaks the Responses API over SSE.

Each completes a non-interactive one-shot run against the CPU model without a protocol error, and
its turns are recorded token-exactly. A tiny model writes no sensible answer: what is tested is that
the harness accepts every response and event we send, and that what it printed is what was stored.
Their prompts are 14-26k tokens (system prompt and tool list), so the engine serves the tiny model
with its position limit raised to 64k (RoPE extends; the weights are unchanged).

The harnesses are installed once per machine from the npm registry (pinned); if npm or the registry
is missing, the tests fail with the reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    engine_and_router,
    running_gateway,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HARNESSES = {"@openai/codex": "0.169.0", "@anthropic-ai/claude-code": "2.1.331"}
LONG_CONTEXT = 65536


@pytest.fixture(scope="module")
def harness_bin(tiny_model_path: Path) -> Path:
    """``node_modules/.bin`` with both harnesses, installed once per machine beside the model cache."""
    npm = shutil.which("npm")
    assert npm is not None, "npm is not installed (.ci/run installs nodejs and npm)"
    tag = "-".join(f"{name.split('/')[-1]}{ver}" for name, ver in HARNESSES.items())
    root = tiny_model_path.parent.parent / f"harness-{tag}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        bin_dir = root / "node_modules" / ".bin"
        if not all((bin_dir / exe).exists() for exe in ("codex", "claude")):
            cmd = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(root),
                   *[f"{name}@{ver}" for name, ver in HARNESSES.items()]]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"npm install of the harnesses failed:\n{done.stderr[-3000:]}"
    return bin_dir


@pytest.fixture(scope="module")
def long_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("long") / "tiny-64k"
    shutil.copytree(tiny_model_path, out)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        data = json.loads((out / name).read_text())
        data[key] = LONG_CONTEXT
        (out / name).write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def router_url(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engine_and_router(long_model, tmp_path_factory.mktemp("stack")) as url:
        yield url


@pytest.fixture
def gateway(router_url: str, long_model: Path, tmp_path: Path) -> Iterator[GatewayProc]:
    with running_gateway(router_url, long_model, tmp_path / "traj.db", tmp_path / "gateway.log") as gw:
        yield gw


def recorded(gw: GatewayProc) -> list:
    store = SQLiteTrajectoryStore(gw.db_path)
    try:
        return store.list_trajectories()
    finally:
        store.close()


def check_token_exact(traj) -> None:
    """Loss mask 1 exactly on generated tokens, each with an engine logprob and a policy version."""
    generated = [i for t in traj.turns for i in range(t.output_start, t.output_end)]
    assert generated and [i for i, m in enumerate(traj.loss_mask) if m] == generated
    assert all(traj.rollout_logprobs[i] <= 0.0 and traj.weight_versions[i] >= 0 for i in generated)


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """The harness's run; its output decoded as it was written: ``text=True`` would read it with universal newlines,
    turning a lone carriage return the model wrote (the tiny model writes any byte) into a newline."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_"))}
    done = subprocess.run(cmd, env={**full, **env}, cwd=cwd, capture_output=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode(errors="replace")
    assert done.returncode == 0, f"{cmd[0]} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def test_claude_code_one_shot_is_recorded(gateway: GatewayProc, harness_bin: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    done = run([str(harness_bin / "claude"), "-p", "Say hi", "--model", MODEL],
               {"HOME": str(home), "ANTHROPIC_BASE_URL": gateway.url, "ANTHROPIC_API_KEY": "EMPTY",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}, tmp_path)
    printed = done.stdout.strip()
    assert printed, done.stderr
    trajs = recorded(gateway)
    main = [t for t in trajs if t.messages and t.messages[-1].content.strip() == printed]
    assert len(main) == 1, [(t.session_id, t.messages[-1].content[:80]) for t in trajs]
    traj = main[0]
    assert re.fullmatch(r"[0-9a-f-]{36}", traj.session_id)  # Claude Code's X-Claude-Code-Session-Id
    assert traj.turns[0].output_start > 10_000  # its whole system prompt and tool list went through
    assert any(m.role == "system" for m in traj.messages)
    check_token_exact(traj)


def test_codex_cli_one_shot_is_recorded(gateway: GatewayProc, harness_bin: Path, tmp_path: Path) -> None:
    home, work = tmp_path / "codex", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "slime"\n\n[model_providers.slime]\nname = "slime"\n'
        f'base_url = "{gateway.base_url}"\nwire_api = "responses"\nenv_key = "SLIME_TEST_KEY"\n')
    done = run([str(harness_bin / "codex"), "exec", "--skip-git-repo-check", "Say hi"],
               {"CODEX_HOME": str(home), "SLIME_TEST_KEY": "EMPTY", "HOME": str(home)}, work)
    session = re.search(r"session id: ([0-9a-f-]{36})", done.stderr)
    assert session, done.stderr[-2000:]
    trajs = [t for t in recorded(gateway) if t.session_id == session.group(1)]  # Codex's session_id header
    assert len(trajs) == 1, [t.session_id for t in recorded(gateway)]
    traj = trajs[0]
    answer = traj.messages[-1].content.strip()
    assert answer and answer in done.stdout  # what Codex printed is what was stored
    assert traj.turns[0].output_start > 5_000
    assert traj.messages[0].role == "system"  # its developer message and instructions
    check_token_exact(traj)
