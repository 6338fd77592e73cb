"""Model parallelism on CPU: two gloo ranks (torchrun-style env vars) must reproduce TP=1.

The TP checkpoint has an odd vocab (101) so TP=2 also exercises vocab padding and slicing, and
GQA (2 KV groups, one per rank), qk-norm and an untied output layer. The PP=2 checkpoint has
tied embeddings, which the last stage must load into its own output layer copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_server.trainer.convert import export_hf_state_dict, load_hf_checkpoint_into, read_hf_state_dict
from slime_server.trainer.model import build_gpt_model, forward_logits
from slime_server.trainer.parallel import parallel_context
from slime_server.utils.net import find_free_port
from tests._megatron_helpers import make_config, save_random_hf_model

WORKER = Path(__file__).with_name("_megatron_tp_worker.py")
REPO = Path(__file__).resolve().parents[1]


def _run_ranks(world_size: int, args: list[str], timeout: float = 180.0, worker: Path = WORKER) -> list[dict]:
    """Run ``worker`` once per rank (gloo, torchrun-style env) and load each rank's results."""
    port = str(find_free_port())
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(worker), *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
    return [torch.load(f"{args[2]}.rank{rank}", weights_only=True) for rank in range(world_size)]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("tp")
    config = make_config("qwen3", num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    hf_dir = root / "hf"
    save_random_hf_model(config, hf_dir)
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(0, config.vocab_size, (2, 12), generator=gen),
        "packed_ids": torch.randint(0, config.vocab_size, (1, 12), generator=gen),
        "packed_positions": torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0),
    }
    torch.save(inputs, root / "inputs.pt")
    ranks = _run_ranks(2, [str(hf_dir), str(root / "inputs.pt"), str(root / "tp2.pt"), "2", "1"])
    tp2 = {**ranks[0], "shards": [r["local"] for r in ranks], "exported_rank1": ranks[1]["exported"]}

    with parallel_context(tp_size=1):
        model = build_gpt_model(config).eval()
        load_hf_checkpoint_into(model, hf_dir)
        with torch.no_grad():
            tp1 = {"logits": forward_logits(model, inputs["input_ids"]),
                   "packed": forward_logits(model, inputs["packed_ids"], inputs["packed_positions"])}
            tp1["packed_a"] = forward_logits(model, inputs["packed_ids"][:, :7])
            tp1["packed_b"] = forward_logits(model, inputs["packed_ids"][:, 7:])
        tp1["exported"] = export_hf_state_dict(model)
    return config, hf_dir, tp1, tp2


def test_tp2_pads_vocab_per_rank(tp_results):
    config, _hf_dir, _tp1, tp2 = tp_results
    assert tp2["layout"]["tp_size"] == 2
    assert tp2["vocab_rows"] == (config.vocab_size + 1) // 2  # 101 padded to 102, 51 rows per rank


def test_tp2_logits_equal_tp1(tp_results):
    config, _hf_dir, tp1, tp2 = tp_results
    assert tp2["logits"].shape == (2, 12, config.vocab_size)
    torch.testing.assert_close(tp2["logits"], tp1["logits"], rtol=0, atol=1e-5)


def test_tp2_packed_forward_equals_tp1_unpacked(tp_results):
    _config, _hf_dir, tp1, tp2 = tp_results
    torch.testing.assert_close(tp2["packed"], tp1["packed"], rtol=0, atol=1e-5)
    torch.testing.assert_close(tp2["packed"][0, :7], tp1["packed_a"][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(tp2["packed"][0, 7:], tp1["packed_b"][0], rtol=0, atol=1e-5)


def test_tp2_export_gathers_bit_identical_hf_weights(tp_results):
    _config, hf_dir, tp1, tp2 = tp_results
    original = read_hf_state_dict(hf_dir)
    for exported in (tp1["exported"], tp2["exported"], tp2["exported_rank1"]):
        assert exported.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), name


def test_tp2_vocab_parallel_shards_mask_their_padding(tp_results):
    config, _hf_dir, tp1, tp2 = tp_results
    first, second = tp2["shards"]
    assert first.shape == second.shape == (2, 12, 51)
    torch.testing.assert_close(torch.cat([first, second[..., :-1]], dim=-1), tp1["logits"], rtol=0, atol=1e-5)
    assert (second[..., -1] == torch.finfo(second.dtype).min).all()
    # The padding column contributes nothing to a vocab-parallel softmax.
    lse = torch.logsumexp(torch.cat([first, second], dim=-1), dim=-1)
    torch.testing.assert_close(lse, torch.logsumexp(tp1["logits"], dim=-1), rtol=0, atol=1e-5)


def test_pp2_stages_load_and_export_their_own_layers(tmp_path):
    config = make_config("qwen3", num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    hf_dir = tmp_path / "hf"
    save_random_hf_model(config, hf_dir, seed=5)
    first, last = _run_ranks(2, [str(hf_dir), "-", str(tmp_path / "pp2.pt"), "1", "2"])
    assert (first["layout"]["pp_rank"], last["layout"]["pp_rank"]) == (0, 1)
    original = read_hf_state_dict(hf_dir)
    assert {k for k in first["exported"] if ".layers." in k} == {k for k in original if ".layers.0." in k}
    assert {k for k in last["exported"] if ".layers." in k} == {k for k in original if ".layers.1." in k}
    assert "model.embed_tokens.weight" in first["exported"] and "model.norm.weight" in last["exported"]
    assert "lm_head.weight" not in last["exported"]  # tied: the engine ties it from embed_tokens
    merged = {**first["exported"], **last["exported"]}
    assert merged.keys() == original.keys()
    assert all(torch.equal(merged[k], original[k]) for k in original)
