"""A real pretrained checkpoint through every part: SmolLM2-135M-Instruct from the package registry.

Llama architecture with what the tiny model lacks: 30 layers, GQA 9/3 heads, tied embeddings, a 49k
byte-level vocabulary and a ChatML template without tool support. The CPU engine answers as HF does
(greedy ids equal, logprobs within 1e-4), HF -> Megatron -> HF is bit-identical with Megatron's logits
within 1e-4 of HF's (eager attention, the same math), a push lands exactly the trainer's export, and a live job's first step sees the
engine's logprobs within 1e-4 of the trainer's.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slime_server.trainer.convert import (
    export_hf_state_dict,
    iter_hf_tensors,
    load_hf_checkpoint_into,
    read_hf_state_dict,
)
from slime_server.trainer.model import build_gpt_model, forward_logits
from slime_server.trainer.parallel import parallel_context
from slime_server.trainer.weight_push import WeightPusher
from tests._engine_helpers import engine_process, hf_logprobs
from tests._jobs_helpers import start_stack
from tests._weight_push_helpers import hf_reference, perturbed, version_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
NEW_TOKENS = 12
ATOL = 1e-4  # the bound for logprobs and logits


@pytest.fixture(scope="module")
def prompts(real_model_path: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(real_model_path))
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf(real_model_path: Path):
    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(str(real_model_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine_url(real_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engine_process(real_model_path, tmp_path_factory.mktemp("engine")) as url:
        yield url


@pytest.fixture(scope="module")
def megatron(real_model_path: Path):
    with parallel_context(tp_size=1):
        config = AutoConfig.from_pretrained(str(real_model_path))
        model = build_gpt_model(config).eval()
        load_hf_checkpoint_into(model, real_model_path)
        yield config, model


def generate(url: str, prompt: list[int], n: int) -> tuple[list[int], list[float], str]:
    """Greedy on the engine, stopping at EOS (kept in ``output_ids``, as SGLang does)."""
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]], out["text"]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF ``generate``, greedy, stopping at the generation config's EOS (included) like the engine."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_the_registry_model_is_the_real_checkpoint(real_model_path: Path) -> None:
    config = AutoConfig.from_pretrained(str(real_model_path))
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings
    from slime_server.server.launch import resolve_model_path

    assert resolve_model_path("smollm2") == str(real_model_path)  # serve --model smollm2
    cli = subprocess.run([sys.executable, "-m", "slime_server.cli", "model", "fetch", "smollm2"], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0 and cli.stdout.strip() == str(real_model_path), cli.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "slime_server.cli", "model", "fetch", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown registry model 'nope'; known: smollm2" in bad.stderr


def test_engine_answers_as_hf(engine_url: str, hf, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        ids, lps, _ = generate(engine_url, prompt, NEW_TOKENS)
        assert ids == hf_greedy(hf, prompt, NEW_TOKENS)
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_logprobs(hf, prompt, ids, 0.0)),
                                   atol=ATOL, rtol=0)
    _, _, text = generate(engine_url, prompts[0], 16)
    assert "Paris" in text


def test_megatron_round_trip_and_logits(megatron, hf, real_model_path: Path, prompts: list[list[int]]) -> None:
    _config, model = megatron
    exported, on_disk = export_hf_state_dict(model), read_hf_state_dict(real_model_path)
    assert set(exported) == set(on_disk) and "lm_head.weight" not in exported  # tied: one tensor
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name
    ids = torch.tensor([prompts[0] + prompts[1] + prompts[2]])
    eager = AutoModelForCausalLM.from_pretrained(str(real_model_path), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        ours, ref, ref_sdpa = forward_logits(model, ids), eager(ids).logits, hf(ids).logits
    # Megatron's CPU attention is HF's eager math: every one of the 109 x 49k logits within 1e-4.
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # HF's default (SDPA) attention orders the same fp32 sums differently: a measurement, not a bound.
    print(f"\nMegatron vs HF eager, {ids.shape[1]} tokens x {ref.shape[-1]} logits: max |diff| "
          f"{(ours - ref).abs().max().item():.1e}; vs HF sdpa {(ours - ref_sdpa).abs().max().item():.1e}")


def test_push_lands_the_trainers_export(megatron, engine_url: str, prompts: list[list[int]]) -> None:
    config, model = megatron
    state = perturbed(model, seed=5, scale=0.002)  # a real change of every weight (runs last: it mutates)
    with WeightPusher([engine_url], bucket_bytes=64 << 20, mode="tensor", sender=True) as pusher:
        stats = pusher.push(iter_hf_tensors(model), version=3)
    assert stats.sent and stats.tensors == len(state) and version_of(engine_url) == "3"
    ref = hf_reference(config, state)
    ids, lps, _ = generate(engine_url, prompts[2], NEW_TOKENS)
    assert ids == hf_greedy(ref, prompts[2], NEW_TOKENS)
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_logprobs(ref, prompts[2], ids, 0.0)),
                               atol=ATOL, rtol=0)


def test_live_job_first_step_sees_the_engines_logprobs(real_model_path: Path,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    from openai import OpenAI

    running = start_stack(real_model_path, tmp_path_factory.mktemp("job"), keys=False)
    try:
        base = running.base_url.removesuffix("/v1")
        with httpx.Client(base_url=base, timeout=300) as c:
            r = c.post("/jobs", json={"name": "real", "algorithm": "reinforce_plus_plus", "optimizer": {"lr": 1e-5},
                                      "loop": {"batch_size": 2, "poll_interval_s": 0.05, "max_staleness": None}})
            assert r.status_code == 200, r.text
            job_id = r.json()["id"]
            client = OpenAI(base_url=running.base_url, api_key="none", max_retries=0)
            for i, q in enumerate(QUESTIONS[:2]):
                sid = f"real-{uuid.uuid4().hex[:8]}"
                client.chat.completions.create(model=Path(real_model_path).name, temperature=1.0, max_tokens=8,
                                               seed=i, messages=[{"role": "user", "content": q}],
                                               extra_headers={"X-Session-Id": sid})
                c.post(f"/v1/sessions/{sid}/reward", json={"reward": float(i)}).raise_for_status()
                c.post(f"/v1/sessions/{sid}/close").raise_for_status()
            metrics = _first_step_metrics(c, job_id)
            c.post(f"/jobs/{job_id}/cancel")
    finally:
        running.stop()
    diff = metrics["train_rollout_logprob_abs_diff"]
    print(f"\nreal model, first step: train_rollout_logprob_abs_diff={diff:.2e}, {metrics.get('tokens', 0):.0f} tokens, "
          f"step {metrics.get('step_seconds', 0):.1f} s, push {metrics.get('push_seconds', 0):.1f} s")
    assert 0 <= diff < ATOL


def _first_step_metrics(c: httpx.Client, job_id: str, timeout: float = 400) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        got = c.get(f"/jobs/{job_id}/metrics").raise_for_status().json()
        if got:
            return got[0]["metrics"]
        j = c.get(f"/jobs/{job_id}").raise_for_status().json()
        assert j["status"] != "failed", j.get("error")
        assert time.monotonic() < deadline, f"no step after {timeout} s: {j}"
        time.sleep(0.5)
