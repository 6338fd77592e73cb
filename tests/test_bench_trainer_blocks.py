"""tools/bench_trainer.py --blocks: the whole Megatron train step with the core attention block by block gives the
loss and gradient norm of Megatron's dense attention (trainer/block_attention.py), on a GRPO batch with shared
prefixes, as jobs train."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_step_with_blocks_equals_the_dense_step() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_trainer.py"), "--blocks", "--batch", "16",
                          "--group", "4", "--system", "24", "--prompt", "8", "--seq-len", "12", "--steps", "1",
                          "--warmup", "0", "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    loss, norm = report["first_loss"], report["first_grad_norm"]
    assert loss["blocks"] == pytest.approx(loss["dense"], rel=1e-5, abs=1e-6)
    assert norm["blocks"] == pytest.approx(norm["dense"], rel=1e-5)
    assert norm["dense"] > 0
