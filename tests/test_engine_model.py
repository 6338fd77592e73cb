"""The engine's model read straight from the checkpoint (rollout/engine_model.py): for every architecture and
RoPE type the lean forward serves, the engine built from the safetensors tensors answers as the engine built on
HF's model (greedy ids, log-probs to 1e-4), before and after a weight update by HF's names; what it does not
serve falls back to HF's model; and an engine start imports none of transformers' modeling code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
from slime_server.rollout.protocol import SamplingParams
from tests._megatron_helpers import make_config, save_random_hf_model

ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 5000.0}
ROPE_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 5000.0}
CASES = {
    "qwen3-qknorm-tied": ("qwen3", dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    "qwen3-attention-bias": ("qwen3", dict(num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)),
    "qwen2-qkv-bias-untied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # attention_bias: q, k, v and o all have a bias (o's is not fused: it must be added on its own)
    "llama3-rope-attention-bias": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                                 attention_bias=True, rope_scaling=ROPE_LLAMA3)),
    "llama-yarn-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling=ROPE_YARN)),
    "mistral-gqa-untied": ("mistral", dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)),
}
# ragged lengths decoded in one batch; the longest reaches past the scaled RoPE's original context
PROMPTS = [[5, 6, 7, 8], list(range(10, 50)), list(range(1, 100)) * 2, [3]]


def _checkpoint(config, path: Path, tokenizer_from: Path):
    """A random HF checkpoint of ``config`` with the tiny model's tokenizer (the engine decodes text)."""
    model = save_random_hf_model(config, path, seed=7)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return model


def _answers(engine: CPUEngine) -> list:
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return [o for outs in pool.map(lambda p: engine.generate(p, sp, return_logprob=True), PROMPTS) for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_read_from_safetensors_answers_as_on_hfs_model(case: str, tmp_path: Path,
                                                                    tiny_model_path: Path) -> None:
    family, overrides = CASES[case]
    model = _checkpoint(make_config(family, **overrides), tmp_path, tiny_model_path)
    engines = {kind: CPUEngine(EngineConfig(model_path=str(tmp_path), max_running_requests=8, forward=kind))
               for kind in ("lean", "hf")}
    try:
        assert engines["lean"].model is None and engines["lean"].lean is not None  # no HF model built
        assert engines["hf"].model is not None and engines["hf"].lean is None
        names = list(model.state_dict())
        assert list(engines["lean"]._params) == names  # weight updates by HF's names reach the same tensors
        for step in range(2):
            got = {kind: _answers(e) for kind, e in engines.items()}
            for a, b in zip(got["lean"], got["hf"], strict=True):
                assert a.output_ids == b.output_ids, (case, step)
                torch.testing.assert_close(torch.tensor([e[0] for e in a.meta_info.output_token_logprobs]),
                                           torch.tensor([e[0] for e in b.meta_info.output_token_logprobs]),
                                           atol=1e-4, rtol=0)  # ARCHITECTURE.md's rule for the fp32 engine
            if step == 0:
                torch.manual_seed(1)
                update = [(n, p.detach() * (1 + 0.3 * torch.rand_like(p))) for n, p in model.state_dict().items()]
                for e in engines.values():
                    e.load_weights(update, "v1")
                before = got["lean"]
        assert [a.output_ids for a in got["lean"]] != [a.output_ids for a in before]  # the update changed answers
    finally:
        for e in engines.values():
            e.shutdown()


def test_what_the_lean_forward_does_not_compute_is_served_on_hfs_model(tmp_path: Path,
                                                                       tiny_model_path: Path) -> None:
    """A RoPE whose frequencies depend on the length (dynamic NTK) and a sliding window keep HF's model."""
    cases = {"dynamic": make_config("llama", num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                                           "rope_theta": 5000.0}),
             "window": make_config("mistral", num_key_value_heads=2, sliding_window=16)}
    for name, config in cases.items():
        _checkpoint(config, tmp_path / name, tiny_model_path)
        engine = CPUEngine(EngineConfig(model_path=str(tmp_path / name)))
        try:
            assert engine.lean is None and engine.model is not None, name
            (out,) = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
            assert len(out.output_ids) == 4
        finally:
            engine.shutdown()


def test_an_engine_start_imports_no_modeling_code(tiny_model_path: Path) -> None:
    """The lean path builds no HF model: transformers' modeling code (~1 s of CPU per engine start) is never
    imported, and the engine still knows the model's EOS ids and weight bytes."""
    code = ("import json, sys\n"
            "from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig\n"
            f"e = CPUEngine(EngineConfig(model_path={str(tiny_model_path)!r}))\n"
            "mods = sorted(m for m in sys.modules if m == 'transformers.modeling_utils' or "
            "m.startswith('transformers.models.') and '.modeling_' in m and not m.endswith('modeling_auto'))\n"
            "print(json.dumps({'mods': mods, 'eos': sorted(e.eos_ids), 'bytes': e.weight_bytes}))\n"
            "e.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["mods"] == []
    cfg = json.loads((tiny_model_path / "config.json").read_text())
    assert cfg["eos_token_id"] in got["eos"]
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_model_path / "model.safetensors"))
    assert got["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())  # tied: counted once


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_decode_matmuls_run_on_the_live_weights(tiny_model_path: Path, monkeypatch, kernel: str) -> None:
    """A decode step's matmuls (up to gemv.MAX_ROWS rows, the prompt's head too) run in gemv.c with their
    norms, SiLU and residual adds folded in, or with ``decode_kernel: torch`` through oneDNN in fp32 (as a
    decode batch over MAX_ROWS does); a prompt's longer ones through F.linear (oneDNN keeps a primitive per
    shape: prompts of every length grew memory). All on the weights as stored (no packed copy to keep in step): after an update in three buckets
    (the embedding, which the tied head shares, in the first) the engine answers as HF's model with them."""
    from slime_server.rollout import gemv, lean_forward
    from tests._engine_helpers import hf_greedy, hf_model

    onednn: list[int] = []
    original = lean_forward._onednn_linear
    monkeypatch.setattr(lean_forward, "_onednn_linear", lambda x, *a: (onednn.append(x.shape[0]), original(x, *a))[1])
    engine = CPUEngine(EngineConfig(model_path=str(tiny_model_path), decode_kernel=kernel))
    try:
        assert engine.lean is not None and (engine.lean._gemv is not None) == (kernel == "c")
        small: list[int] = []
        if kernel == "c":
            fused = engine.lean._gemv
            engine.lean._gemv = lambda x, w, b=None, **kw: (small.append(x.shape[0]), fused(x, w, b, **kw))[1]
        sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        prompt = PROMPTS[1]
        assert len(prompt) > gemv.MAX_ROWS
        ref = hf_model(tiny_model_path)
        assert engine.generate(prompt, sp)[0].output_ids == hf_greedy(ref, prompt, 8)
        layers = len(engine.lean.layers)
        rows = [1] * (1 + 7 * (4 * layers + 1))  # the prompt's head; 7 decode steps: 4 per layer and the head
        assert (small, onednn) == ((rows, []) if kernel == "c" else ([], rows))
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(-1.0)
        named = list(ref.state_dict().items())
        thirds = [named[: len(named) // 3], named[len(named) // 3: 2 * len(named) // 3], named[2 * len(named) // 3:]]
        assert any(n == "model.embed_tokens.weight" for n, _ in thirds[0])
        for i, bucket in enumerate(thirds):
            engine.load_weights(bucket, "neg" if i == 2 else None)
        assert engine.generate(prompt, sp)[0].output_ids == hf_greedy(ref, prompt, 8)
    finally:
        engine.shutdown()
