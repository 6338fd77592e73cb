"""Weight push from a tensor-parallel trainer (two real Megatron processes) into a real engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_server.utils.net import find_free_port
from tests._engine_helpers import hf_greedy, hf_logprobs
from tests._weight_push_helpers import NEW_TOKENS, PROMPT, engine_processes, greedy, hf_reference, version_of

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).with_name("_weight_push_worker.py")


def test_tensor_parallel_ranks_only_tp0_sends(tiny_model_path: Path, tmp_path: Path):
    """TP=2 in two real processes: both gather, only TP rank 0 sends, the engine gets the full tensors."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_model_path))
    with engine_processes([tiny_model_path], tmp_path) as (url,):
        results = run_ranks(tiny_model_path, url, tmp_path / "result")
        assert [r["layout"]["tp_rank"] for r in results] == [0, 1]
        assert [r["stats"]["sent"] for r in results] == [True, False]
        assert results[0]["stats"]["tensors"] == results[1]["stats"]["tensors"] > 0
        assert results[0]["stats"]["buckets"] > 1 and version_of(url) == "tp2pp1"
        ids, lps, _ = greedy(url)
    ref = hf_reference(config, results[0]["exported"])
    assert ids == hf_greedy(ref, PROMPT, NEW_TOKENS)
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_logprobs(ref, PROMPT, ids, 0.0)),
                               atol=1e-4, rtol=0)


def test_pipeline_stages_stream_to_the_first_which_sends(tiny_model_path: Path, tmp_path: Path):
    """PP=2 (issue 19): the last stage streams its layers to the first stage's rank, the only one that talks to
    the engine; the engine serves both stages' layers (greedy ids and log-probs as HF on the merged export)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_model_path))
    with engine_processes([tiny_model_path], tmp_path) as (url,):
        results = run_ranks(tiny_model_path, url, tmp_path / "result", tp=1, pp=2)
        assert [r["layout"]["pp_rank"] for r in results] == [0, 1]
        assert [r["stats"]["sent"] for r in results] == [True, False]
        first, last = (set(r["exported"]) for r in results)
        assert not {k for k in first & last if ".layers." in k}  # each stage holds its own layers
        assert results[0]["stats"]["tensors"] == len(first | last)  # the sender sent both stages'
        assert version_of(url) == "tp1pp2"
        ids, lps, _ = greedy(url)
    ref = hf_reference(config, {**results[0]["exported"], **results[1]["exported"]})
    assert ids == hf_greedy(ref, PROMPT, NEW_TOKENS)
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_logprobs(ref, PROMPT, ids, 0.0)),
                               atol=1e-4, rtol=0)


def run_ranks(hf_dir: Path, url: str, out: Path, tp: int = 2, pp: int = 1) -> list[dict]:
    """The worker once per rank (gloo, torchrun-style env); each rank's saved result."""
    port = str(find_free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        # Logs go to files, not pipes: the sender starts torch's shared-memory manager (CPU payloads of
        # /update_weights_from_tensor), which inherits its stdout and lives as long as the engine it serves.
        log = open(f"{out}.log{rank}", "w")  # noqa: SIM115  (closed below)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(hf_dir), url, str(out), str(tp), str(pp)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
        log.close()
    try:
        for p in procs:
            p.wait(timeout=150)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [Path(f"{out}.log{rank}").read_text() for rank in range(2)]
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-3000:]}"
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(2)]
