"""tools/bench_gemv_threads.py: one thread against the team per gemv.c call, under each OpenMP wait policy."""

from __future__ import annotations

import pytest

from tests._tools_helpers import load_tool


def test_gemv_threads_bench_times_both_counts_under_both_policies(capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_tool("bench_gemv_threads.py")
    rows = tool.main(["--rows", "1", "--shapes", "64x32", "--threads", "2", "--budget", "1e5"])
    assert [(r["policy"], r["shape"], r["macs"]) for r in rows] == [("passive", "64x32", 2048), ("default", "64x32", 2048)]
    assert all(t > 0 for r in rows for t in r["solo_us"] + r["team_us"])
    table = capsys.readouterr().out
    assert "OMP_WAIT_POLICY=passive (one thread below 4,000,000" in table and table.count("| 1\n") == 1
    assert "OMP_WAIT_POLICY=default (one thread below 0" in table and table.count("| team\n") == 1
