"""Helpers for the engine tests: start a real engine server process, and HF reference computations."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from slime_server.rollout.owned import start_retrying
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group, python_module_cmd, spawn


@contextlib.contextmanager
def engine_process(model_path: Path, log_dir: Path, *extra: str) -> Iterator[str]:
    """``python -m slime_server.rollout.engine_server`` on a free port; yields its URL (``engine_process_and_pid``
    also its pid)."""
    with engine_process_and_pid(model_path, log_dir, *extra) as (url, _):
        yield url


@contextlib.contextmanager
def engine_process_and_pid(model_path: Path, log_dir: Path, *extra: str) -> Iterator[tuple[str, int]]:
    """``python -m slime_server.rollout.engine_server`` on a free port; yields its URL and pid. The port is free when
    picked but another test's process may bind it first (CI saw uvicorn exit 3, address already in use): then
    a new port, up to three tries."""
    started: dict = {}

    def launch() -> None:
        port = find_free_port()
        cmd = python_module_cmd("slime_server.rollout.engine_server", "--model-path", str(model_path),
                                "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1", *extra)
        log = log_dir / f"engine-{port}.log"
        started.update(url=f"http://127.0.0.1:{port}", log=log,
                       proc=spawn(cmd, env={"OMP_NUM_THREADS": "1"}, log_path=str(log)))

    start_retrying(launch, lambda: wait_http_ok(f"{started['url']}/health", timeout=120, proc=started["proc"]),
                   lambda: kill_group(started["proc"]),
                   lambda: "address already in use" in started["log"].read_text(errors="replace"))
    url, proc = started["url"], started["proc"]
    try:
        yield url, proc.pid
    finally:
        kill_group(proc)


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """Every thread of process ``pid`` -> the cores it may run on (what ``utils/affinity.pin_process`` set)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            continue
    return out


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """Log-probs of ``output`` after ``prompt`` by one full forward (the engine's temperature rule)."""
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy tokens as an engine picks them with ``ignore_eos``: the argmax at every step, EOS included.

    Not ``generate(min_new_tokens=...)``: that masks EOS, while SGLang's ``ignore_eos`` (and our engine) only
    keeps going past it. A model whose argmax was EOS then failed the comparison: the push tests' randomly
    initialised models did so in ~5% of runs."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    ids: list[int] = []
    while True:
        ids.append(int(out.logits[0, -1].argmax()))
        if len(ids) == max_new_tokens:
            return ids
        out = model(input_ids=torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
