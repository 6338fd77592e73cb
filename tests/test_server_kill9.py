"""The whole server killed with ``kill -9`` under traffic, mid-job (issues 9 and 17): on restart every
turn and reward it answered is in the store exactly as the client saw it (bytes, log-probs, reward
values; multi-turn sessions), a turn nobody saw answered is complete or absent, the job resumes
from its last checkpoint, and the killed trainer ranks' weight buckets no longer hold RAM.

`slime-server serve` runs as a real subprocess in its own process group (engines, router, Ray,
trainer ranks, gateway); SIGKILL to the group is the crash. Nothing is flushed on the way down.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import httpx
import openai
import pytest
from openai import OpenAI

from slime_server.utils.net import find_free_port
from slime_server.utils.shm import torch_shm_files
from tests._cli_helpers import CLI, output_lines, wait_for
from tests._jobs_helpers import ADMIN, AGENT, create_job, drive, wait_event, wait_job
from tests._rollout_helpers import pid_alive, proc_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
T = TypeVar("T")


def _serve(model: Path, work: Path, port: int) -> tuple[subprocess.Popen, SimpleNamespace]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [str(CLI), "serve", "--model", str(model), "--num-engines", "1", "--ray-num-cpus", "3", "--port", str(port),
         "--api-key", AGENT, "--admin-api-key", ADMIN, "--db-path", str(work / "db.sqlite"),
         "--trainer-work-dir", str(work / "jobs"), "--log-dir", str(work / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    base_url = wait_for(output_lines(proc), "openai_base_url:", 240, proc)
    deadline = time.monotonic() + 30
    while True:  # uvicorn binds just after the line is printed
        try:
            httpx.get(f"{base_url}/models", timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    return proc, SimpleNamespace(base_url=base_url, deployment=SimpleNamespace(model_path=str(model)))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    tree = proc_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for pid, start in tree.items():  # Ray daemons leave the group: a crash takes them down too
        if pid_alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Seen:
    """What the clients were answered: per turn its bytes and log-probs, per session its reward."""

    turns: dict[str, list[tuple[str, bytes, list[float]]]] = field(default_factory=dict)  # sid -> (id, bytes, lps)
    rewards: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _paced(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(...)``, waiting out buffer pacing (429: the job's buffer is full; a new episode waits)."""
    while True:
        try:
            out = call(*args, **kwargs)
        except openai.RateLimitError:
            time.sleep(0.5)
            continue
        if isinstance(out, httpx.Response) and out.status_code == 429:
            time.sleep(0.5)
            continue
        return out


def _agent(server: SimpleNamespace, k: int, seen: Seen, stop: threading.Event) -> None:
    """Multi-turn episodes (3 turns, then a reward) until the server dies or ``stop``."""
    client = OpenAI(base_url=server.base_url, api_key=AGENT, max_retries=0, timeout=60)
    rest = httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {AGENT}"})
    try:
        while not stop.is_set():
            sid = f"agent{k}-{uuid.uuid4().hex[:8]}"
            messages = [{"role": "user", "content": f"Count to {k}."}]
            for _ in range(3):
                r = _paced(client.chat.completions.create, model=Path(server.deployment.model_path).name,
                           messages=messages, max_tokens=6, temperature=1.0, logprobs=True,
                           extra_headers={"X-Session-Id": sid})
                content = r.choices[0].logprobs.content
                with seen.lock:
                    seen.turns.setdefault(sid, []).append(
                        (r.id, b"".join(bytes(c.bytes or []) for c in content), [c.logprob for c in content]))
                messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
            reward = random.random()
            _paced(rest.post, f"/sessions/{sid}/reward", json={"reward": reward}).raise_for_status()
            with seen.lock:
                seen.rewards[sid] = reward
    except Exception:  # noqa: BLE001 - the server was killed under this agent: its last call had no answer
        return
    finally:
        rest.close()


def _check_store(c: httpx.Client, seen: Seen, tok) -> int:
    """Every answered turn is stored with exactly the bytes and log-probs its client saw, every answered
    reward with its value; a stored turn nobody saw answered is complete and the session's last."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)

    def token_bytes(token_id: int) -> bytes:  # the byte-level BPE token's own bytes, as the API reports them
        piece = tok.convert_ids_to_tokens(token_id)
        if piece is None:  # the tiny model's vocabulary is padded past its tokenizer's: no bytes
            return b""
        return piece.encode() if token_id in special else bytes(byte_of[ch] for ch in piece)

    unseen = 0
    for sid, turns in seen.turns.items():
        [traj] = c.get(f"/sessions/{sid}/trajectory").raise_for_status().json()  # one merged trajectory
        stored = traj["turns"]
        assert [t["response_id"] for t in stored[: len(turns)]] == [rid for rid, _, _ in turns], sid
        assert len(stored) - len(turns) in (0, 1), sid  # at most the turn in flight at the kill
        unseen += len(stored) - len(turns)
        tokens, mask, lps = traj["tokens"], traj["loss_mask"], traj["rollout_logprobs"]
        for i, t in enumerate(stored):
            span = range(t["output_start"], t["output_end"])
            assert t["output_end"] > t["output_start"] and all(mask[j] == 1 and lps[j] <= 0 for j in span), sid
            assert not any(mask[t["prompt_start"]:t["output_start"]]), sid
            if i < len(turns):
                _, text, logprobs = turns[i]
                assert [lps[j] for j in span] == logprobs, sid  # the very values the client got
                assert b"".join(token_bytes(tokens[j]) for j in span) == text, sid
        assert sum(mask) == sum(t["output_end"] - t["output_start"] for t in stored)
        if sid in seen.rewards:
            assert traj["reward"] == seen.rewards[sid] and traj["status"] == "finished", sid
    return unseen


def test_server_kill_9_under_traffic_loses_nothing_and_the_job_resumes(tiny_model_path: Path, tmp_path: Path) -> None:
    """8 agents mid-turn and a job training when the whole server is killed (issue 17)."""
    from transformers import AutoTokenizer

    port = find_free_port()
    proc, server = _serve(tiny_model_path, tmp_path, port)
    seen, stop = Seen(), threading.Event()
    try:
        j = create_job(server, batch_size=4, checkpoint_interval=2, max_staleness=None)
        wait_event(server, j["id"], "trainer_ready")
        agents = [threading.Thread(target=_agent, args=(server, k, seen, stop), daemon=True) for k in range(8)]
        for a in agents:
            a.start()
        j = wait_job(server, j["id"], lambda x: x["step"] >= 3)
        checkpointed = j["checkpoints"][-1]["step"]  # 2, or 4 when the job ran two steps between polls
        assert checkpointed >= 2
        assert all(a.is_alive() for a in agents)  # every agent is mid-episode at the kill
    finally:
        _kill_group(proc)
    for a in agents:
        a.join(timeout=60)
    assert not any(a.is_alive() for a in agents)
    # the killed ranks' weight buckets are still in /dev/shm (Ray's kill took torch's manager too); the server
    # recorded its ranks, and the next one on this host removes what they left
    registry = tmp_path / "jobs" / ".ranks"
    dead = {int(m.rpartition("@")[2]) for m in os.listdir(registry)}
    deadline = time.monotonic() + 30
    while alive := [(pid, _cmdline(pid)) for pid in dead if pid_alive(pid)]:  # SIGKILL lands asynchronously
        assert time.monotonic() < deadline, alive
        time.sleep(0.1)
    assert dead and any(torch_shm_files().get(pid) for pid in dead)

    proc, server = _serve(tiny_model_path, tmp_path, port)
    try:
        assert not any(torch_shm_files().get(pid) for pid in dead)
        assert not {int(m.rpartition("@")[2]) for m in os.listdir(registry)} & dead
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as c:
            unseen = _check_store(c, seen, AutoTokenizer.from_pretrained(tiny_model_path))
        n_turns = sum(len(t) for t in seen.turns.values())
        multi = sum(len(t) > 1 for t in seen.turns.values())
        print(f"{n_turns} answered turns in {len(seen.turns)} sessions ({multi} multi-turn), {len(seen.rewards)} "
              f"rewards; {unseen} stored turns were never answered (committed, then the kill)")
        assert len(seen.rewards) >= 4 and multi >= 8
        resumed = wait_event(server, j["id"], "resumed")["data"]
        # the last checkpoint before the kill (the job may have taken another one between the poll and the kill)
        assert resumed["from_step"] >= checkpointed and resumed["from_step"] % 2 == 0
        drive(server, 4)
        done = wait_job(server, j["id"], lambda x: x["step"] > resumed["from_step"] and x["status"] == "running")
        assert done["policy_version"] > j["policy_version"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
