"""Shared helpers for the trainer tests: a deterministic RL batch and a launcher for worker ranks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).with_name("_trainer_worker.py")


def make_batch(vocab_size: int, n: int = 6, seed: int = 0, min_len: int = 12, max_len: int = 40,
               shared: bool = False) -> list[Any]:
    """``n`` samples of random length: a prompt (mask 0) then a response (mask 1) with advantages
    of both signs and rollout log-probs near (but not equal to) a plausible value. ``shared``: as a
    job's GRPO batch, every sample starts with the same 4 tokens (a system prompt) and the two samples
    of a group share their whole prompt."""
    from slime_server.trainer.types import TrainSample

    rng = random.Random(seed)
    samples = []
    system = [rng.randrange(vocab_size) for _ in range(4)]
    group_prompt: list[int] = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        prompt = rng.randint(3, length // 2)
        tokens = [rng.randrange(vocab_size) for _ in range(length)]
        if shared:
            if i % 2 == 0:
                prompt = max(prompt, 6)
                group_prompt = system + tokens[4:prompt]
            prompt = len(group_prompt)
            tokens = group_prompt + [rng.randrange(vocab_size) for _ in range(max(length - prompt, 3))]
            length = len(tokens)
        mask = [0] * prompt + [1] * (length - prompt)
        adv = rng.uniform(-1.5, 1.5)
        samples.append(TrainSample(
            tokens=tokens, loss_mask=mask,
            rollout_logprobs=[(-rng.uniform(2.0, 6.0) if m else 0.0) for m in mask],
            reward=adv, group_id=f"g{i // 2}", weight_versions=[0 if m else -1 for m in mask],
            advantages=[adv if m else 0.0 for m in mask], sample_id=f"s{i}",
        ))
    return samples


def write_inputs(tmp: Path, settings: Any, samples: list[Any]) -> tuple[Path, Path]:
    settings_path, batch_path = tmp / "settings.json", tmp / "batch.json"
    settings_path.write_text(settings.model_dump_json())
    batch_path.write_text(json.dumps([s.model_dump(mode="json") for s in samples]))
    return settings_path, batch_path


def run_ranks(world_size: int, args: list[str], timeout: float = 240.0) -> None:
    """Run ``world_size`` copies of the worker as one torch.distributed group; fail on any error. Rank 0 binds the
    rendezvous first, on a port the OS picks, and the others are started with it (a port chosen here and bound
    later by rank 0 could be taken in between by another test worker's process)."""
    import tempfile
    import time

    procs: list[subprocess.Popen] = []

    def start(rank: int, port: int, extra: dict[str, str]) -> None:
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **extra}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))

    outputs = []
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        try:
            start(0, 1, {"SLIME_PORT_FILE": str(port_file)} if world_size > 1 else {})  # port 1: unused by rank 0
            deadline = time.monotonic() + timeout
            while world_size > 1 and not port_file.exists():
                if procs[0].poll() is not None:
                    raise AssertionError("rank 0 exited before it opened the rendezvous:\n"
                                         + procs[0].communicate()[0].decode(errors="replace")[-4000:])
                assert time.monotonic() < deadline, "rank 0 did not open the rendezvous in time"
                time.sleep(0.05)
            for rank in range(1, world_size):
                start(rank, int(port_file.read_text()), {})
            for p in procs:
                out, _ = p.communicate(timeout=timeout)
                outputs.append(out.decode(errors="replace"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed (rc={p.returncode}):\n{out[-4000:]}"


def run_plan(world_size: int, plan_dir: Path, jobs: list[dict[str, Any]], timeout: float = 600.0) -> None:
    """Several runs (the worker's flags as keys: settings, batch, out, steps, save_at, ckpt, load) one after another
    in the same ``world_size`` rank processes: one interpreter and megatron import per rank for all of them."""
    path = plan_dir / f"plan-world{world_size}.json"
    path.write_text(json.dumps([{k: str(v) if isinstance(v, Path) else v for k, v in job.items()} for job in jobs]))
    run_ranks(world_size, ["--plan", str(path)], timeout=timeout)


def load_result(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)
