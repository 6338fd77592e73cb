"""An MoE model under tensor and expert parallelism on CPU (issue 44): two gloo ranks with TP=2, and two with EP=2
(each holding half the experts, the allgather dispatcher moving tokens between them, each rank its own inputs),
give TP=1/EP=1's logits, natural and replaying forced routes, and export every expert back to HF's names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_server.trainer import routing_replay
from slime_server.trainer.convert import export_hf_state_dict, load_hf_checkpoint_into, read_hf_state_dict
from slime_server.trainer.model import build_gpt_model, forward_logits
from slime_server.trainer.parallel import parallel_context
from tests._megatron_helpers import save_random_hf_model
from tests.test_megatron_tp import _run_ranks
from tests.test_moe_trainer import EXPERTS, TOPK, moe_config

WORKER = Path(__file__).with_name("_megatron_moe_worker.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The checkpoint, two ranks' inputs (each its own tokens and forced routes) and TP=1/EP=1's answers."""
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("moe-parallel")
    config = moe_config()
    save_random_hf_model(config, root / "hf")
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for n in (12, 12):  # the allgather dispatcher gathers equal token counts from every EP rank
        ids = torch.randint(0, config.vocab_size, (1, n), generator=gen)
        forced = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(n * 2)]).view(n, 2, TOPK)
        inputs.append({"ids": ids, "forced": forced})
    torch.save(inputs, root / "inputs.pt")
    answers = []
    with parallel_context(tp_size=1):
        model = build_gpt_model(config).eval()
        load_hf_checkpoint_into(model, root / "hf")
        with torch.no_grad():
            for x in inputs:
                with routing_replay.replaying(model, x["forced"]):
                    replayed = forward_logits(model, x["ids"])
                answers.append({"logits": forward_logits(model, x["ids"]), "replayed": replayed})
        exported = export_hf_state_dict(model)
    return root, answers, exported


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_model_parallel_moe_equals_one_rank(reference, tp: int, ep: int) -> None:
    root, answers, exported = reference
    ranks = _run_ranks(2, [str(root / "hf"), str(root / "inputs.pt"), str(root / f"tp{tp}ep{ep}.pt"), str(tp),
                           str(ep)], worker=WORKER)
    original = read_hf_state_dict(root / "hf")
    for got in ranks:
        assert got["experts"] == EXPERTS // ep  # EP: each rank holds its half
        want = answers[got["layout"]["dp_rank"]]
        torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["replayed"], want["replayed"], rtol=0, atol=1e-5)
        assert (got["replayed"] - got["logits"]).abs().max() > 1e-3  # the forced routes changed the answer
        assert got["exported"].keys() == original.keys() == exported.keys()  # every expert, from every rank
        assert all(torch.equal(got["exported"][k], original[k]) for k in original)
