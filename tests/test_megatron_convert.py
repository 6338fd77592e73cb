"""HF <-> Megatron-core conversion, logits parity, packed forward and the conversion tools (CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_server.trainer.convert import (
    export_hf_state_dict,
    gather_from_tp,
    hf_to_megatron,
    load_hf_checkpoint_into,
    load_megatron_state_into,
    megatron_to_hf,
    read_hf_state_dict,
    split_for_tp,
)
from slime_server.trainer.model import arch_from_hf_config, build_gpt_model, forward_logits
from slime_server.trainer.parallel import parallel_context
from tests._megatron_helpers import make_config, save_random_hf_model
from tests._tools_helpers import load_tool

REPO = Path(__file__).resolve().parents[1]

CASES = {
    # GQA with a single KV group, untied.
    "llama-gqa1-untied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    # MHA (kv heads == heads), tied.
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # qkv bias, GQA, untied.
    "qwen2-bias-untied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # qk-norm, head_dim != hidden/heads, tied.
    "qwen3-qknorm-tied": ("qwen3", dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    # Llama 3.1-style RoPE scaling, GQA, untied: an original context of 32 puts the 8 frequencies of a
    # 16-dim head in all three bands (kept, smoothed, divided by the factor).
    "llama3-rope-scaled": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 5000.0})),
    # Mistral (Llama layout; no sliding window), GQA, untied.
    "mistral-gqa-untied": ("mistral", dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)),
}


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    torch.set_num_threads(2)
    with parallel_context(tp_size=1) as layout:
        yield layout


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    config = make_config(family, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_random_hf_model(config, path)
    megatron = build_gpt_model(config).eval()
    load_hf_checkpoint_into(megatron, path)
    return config, path, hf_model, megatron


def test_logits_match_hf(hf_case):
    config, _path, hf_model, megatron = hf_case
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = forward_logits(megatron, ids)
        ref = hf_model(ids).logits
    assert ours.shape == ref.shape == (2, 13, config.vocab_size)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


def test_export_is_bit_identical(hf_case):
    config, path, hf_model, megatron = hf_case
    exported = export_hf_state_dict(megatron)
    on_disk = read_hf_state_dict(path)
    assert set(exported) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name
    in_memory = hf_model.state_dict()
    missing = set(in_memory) - set(exported)
    assert missing == ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert all(torch.equal(exported[k], in_memory[k]) for k in exported)


def test_pure_mapping_roundtrip_and_tp_split(hf_case):
    config, path, _hf_model, _megatron = hf_case
    arch = arch_from_hf_config(config)
    hf_state = read_hf_state_dict(path)
    for fused in (False, True):
        full = hf_to_megatron(hf_state, arch, fused_norms=fused)
        assert any(k.endswith("layer_norm_weight") for k in full) is fused
        back = dict(megatron_to_hf(full, arch))
        assert back.keys() == hf_state.keys()
        assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    for name, tensor in full.items():
        shards = [split_for_tp(name, tensor, r, 2) for r in range(2)]
        assert torch.equal(gather_from_tp(name, shards), tensor), name


def test_fc1_shards_keep_gate_and_up_paired(hf_case):
    config, path, _hf_model, _megatron = hf_case
    arch = arch_from_hf_config(config)
    hf_state = read_hf_state_dict(path)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    shard1 = split_for_tp(name, hf_to_megatron(hf_state, arch)[name], 1, 2)
    half = arch.ffn_hidden_size // 2
    assert torch.equal(shard1[:half], hf_state["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(shard1[half:], hf_state["model.layers.0.mlp.up_proj.weight"][half:])


def test_packed_forward_equals_unpacked(hf_case):
    config, _path, _hf_model, megatron = hf_case
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, config.vocab_size, (1, 5), generator=gen)
    b = torch.randint(0, config.vocab_size, (1, 8), generator=gen)
    c = torch.randint(0, config.vocab_size, (1, 13), generator=gen)
    # Row 0 packs a|b; row 1 holds c unpacked: rows with different packing share one batch.
    packed_ids = torch.cat([torch.cat([a, b], dim=1), c], dim=0)
    positions = torch.stack([torch.cat([torch.arange(5), torch.arange(8)]), torch.arange(13)])
    with torch.no_grad():
        packed = forward_logits(megatron, packed_ids, positions)
        la, lb, lc = (forward_logits(megatron, x) for x in (a, b, c))
    torch.testing.assert_close(packed[0, :5], la[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[0, 5:], lb[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[1], lc[0], rtol=0, atol=1e-5)
    # Without the reset positions the second sample is NOT equal: the test can fail.
    with torch.no_grad():
        naive = forward_logits(megatron, packed_ids[:1])
    assert (naive[0, 5:] - lb[0]).abs().max() > 1e-3


def test_right_padding_mask_does_not_change_real_tokens(hf_case):
    config, _path, _hf_model, megatron = hf_case
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 4)], dim=1).long()
    with torch.no_grad():
        ref = forward_logits(megatron, ids)
        out = forward_logits(megatron, padded, attention_mask=mask)
    torch.testing.assert_close(out[:, :9], ref, rtol=0, atol=1e-5)


def test_loading_megatron_state_rejects_missing_and_misshaped(hf_case):
    config, path, _hf_model, megatron = hf_case
    full = hf_to_megatron(read_hf_state_dict(path), arch_from_hf_config(config))
    broken = dict(full)
    del broken["decoder.final_layernorm.weight"]
    with pytest.raises(KeyError, match="final_layernorm"):
        load_megatron_state_into(megatron, broken)
    broken = dict(full, **{"decoder.final_layernorm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="final_layernorm"):
        load_megatron_state_into(megatron, broken)


def test_unsupported_configs_are_rejected():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type"):
        arch_from_hf_config(GPT2Config())
    with pytest.raises(ValueError, match="hidden_act"):
        arch_from_hf_config(make_config("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="RoPE"):
        arch_from_hf_config(make_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="sliding"):
        arch_from_hf_config(make_config("qwen2", use_sliding_window=True, sliding_window=16))
    with pytest.raises(ValueError, match="sliding"):
        arch_from_hf_config(make_config("mistral", sliding_window=16))
    with pytest.raises(ValueError, match="TP"):
        arch_from_hf_config(make_config("qwen3", num_key_value_heads=1), tp_size=2)


def test_hf_checkpoint_missing_tensor_is_a_clear_error(tmp_path):
    config = make_config("qwen2", num_key_value_heads=2)
    save_random_hf_model(config, tmp_path)
    state = read_hf_state_dict(tmp_path)
    del state["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(KeyError, match="k_proj.bias"):
        hf_to_megatron(state, arch_from_hf_config(config))
    state["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(32)
    state["model.extra.weight"] = torch.zeros(2)
    with pytest.raises(KeyError, match="no Megatron counterpart"):
        hf_to_megatron(state, arch_from_hf_config(config))


def _run_tool(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / script), *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_conversion_tools_roundtrip_tiny_model(tiny_model_path, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    mg_dir, hf_dir = tmp_path / "megatron", tmp_path / "hf"
    done = _run_tool("convert_hf_to_megatron.py", "--hf-dir", str(tiny_model_path), "--out-dir", str(mg_dir))
    assert done.returncode == 0, done.stderr
    done = _run_tool("convert_megatron_to_hf.py", "--megatron-dir", str(mg_dir), "--out-dir", str(hf_dir))
    assert done.returncode == 0, done.stderr

    original, converted = read_hf_state_dict(tiny_model_path), read_hf_state_dict(hf_dir)
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[k], converted[k]) for k in original)
    assert (hf_dir / "config.json").read_text() == (tiny_model_path / "config.json").read_text()
    text = "<|im_start|>user\nhello<|im_end|>"
    assert AutoTokenizer.from_pretrained(hf_dir)(text).input_ids == AutoTokenizer.from_pretrained(
        tiny_model_path)(text).input_ids

    # The Megatron checkpoint itself loads into a GPTModel and matches the HF model's logits.
    from slime_server.trainer.convert_files import read_megatron_dir

    state, meta = read_megatron_dir(mg_dir)
    config = AutoConfig.from_pretrained(tiny_model_path)
    assert meta.model_type == config.model_type
    megatron = build_gpt_model(config).eval()
    load_megatron_state_into(megatron, state)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()(ids).logits
        torch.testing.assert_close(forward_logits(megatron, ids), ref, rtol=0, atol=1e-4)


def _tool_main(script: str):
    return load_tool(script).main


def test_conversion_tools_report_bad_input(tmp_path, capsys):
    to_hf = _tool_main("convert_megatron_to_hf.py")
    assert to_hf(["--megatron-dir", str(tmp_path), "--out-dir", str(tmp_path / "x")]) == 2
    assert "slime_megatron.json" in capsys.readouterr().err
    to_megatron = _tool_main("convert_hf_to_megatron.py")
    assert to_megatron(["--hf-dir", str(tmp_path), "--out-dir", str(tmp_path / "y")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_sharded_bf16_checkpoint_loads_as_its_values(tmp_path):
    """A bf16 checkpoint in several safetensors shards (``model.safetensors.index.json``), as Hugging Face
    ships real models: the trainer reads every shard and holds exactly the bf16 values, in fp32."""
    config = make_config("llama", num_key_value_heads=2, tie_word_embeddings=False)
    hf_model = save_random_hf_model(config, tmp_path / "fp32")
    hf_model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"), max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "bf16").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    megatron = build_gpt_model(config).eval()
    load_hf_checkpoint_into(megatron, tmp_path / "bf16")
    exported = export_hf_state_dict(megatron)
    bf16_values = {k: v.float() for k, v in hf_model.state_dict().items()}
    assert set(exported) == set(bf16_values)
    for name, tensor in exported.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, bf16_values[name]), name
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(megatron, ids), reference(ids).logits, rtol=0, atol=1e-4)
