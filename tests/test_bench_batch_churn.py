"""tools/bench_batch_churn.py, the CPU engine under a decode batch whose members keep changing."""

from __future__ import annotations

import random

import pytest

from tests._tools_helpers import load_tool


def test_batch_churn_bench_runs_and_counts_every_token(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/bench_batch_churn.py (docs/benchmarks.md): each run generates every request's tokens."""
    tool = load_tool("bench_batch_churn.py")
    cpu = tool.main(["--requests", "12", "--reps", "2", "--concurrency", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert len(cpu) == 2 and all(c > 0 for c in cpu)
    rng = random.Random(0)  # the bench's workload: (prompt length, output length) per request, in this order
    want = sum([rng.randint(20, 200), rng.randint(5, 60)][1] for _ in range(12))
    assert [int(line.split()[2]) for line in lines] == [want, want]  # ignore_eos: every requested token
