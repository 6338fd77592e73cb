"""Helpers for the weight-push tests: engine processes, greedy probes, HF references."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from slime_server.rollout.protocol import MetaInfo
from slime_server.trainer.convert import export_hf_state_dict
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group, python_module_cmd, spawn

PROMPT = [11, 12, 13, 14, 15, 16, 17]
NEW_TOKENS = 8


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Add noise to every Megatron parameter (a real change of weights); returns the HF export."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return export_hf_state_dict(model)


def hf_reference(config, state: dict[str, torch.Tensor]):
    """A transformers model holding exactly the trainer's exported weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    return model


def greedy(url: str) -> tuple[list[int], list[float], list[str]]:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    r.raise_for_status()
    out = r.json()
    meta = out["meta_info"]
    versions = MetaInfo.model_validate(meta).token_versions(len(out["output_ids"]))
    return out["output_ids"], [lp[0] for lp in meta["output_token_logprobs"]], versions


def version_of(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


@contextlib.contextmanager
def engine_processes(model_paths: list[Path], log_dir: Path) -> Iterator[list[str]]:
    """Several engine servers started at once (startup dominates this file's time); yields URLs."""
    procs, urls = [], []
    try:
        for path in model_paths:
            port = find_free_port()
            cmd = python_module_cmd("slime_server.rollout.engine_server", "--model-path", str(path),
                                    "--port", str(port), "--num-threads", "1")
            procs.append(spawn(cmd, env={"OMP_NUM_THREADS": "1"}, log_path=str(log_dir / f"engine-{port}.log")))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_http_ok(f"{url}/health", timeout=120, proc=proc)
        yield urls
    finally:
        for proc in procs:
            kill_group(proc)
