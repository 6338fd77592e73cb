"""Serving is never refused while weights are pushed: 8 ``openai`` SDK clients through the gateway,
the sgl-router and two CPU engines while ten bucketed pushes roll engine by engine (the short
version of ``tools/bench_online.py``; latency ratios are the benchmark's job, not this test's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._tools_helpers import load_tool

pytestmark = pytest.mark.timeout(600)


def load_bench():
    return load_tool("bench_online.py")


def test_no_failed_request_across_ten_rolling_pushes(tiny_model_path: Path, tmp_path: Path) -> None:
    bench = load_bench()
    res = bench.run_bench(str(tiny_model_path), engines=2, clients=8, pushes=10, burst=2, quiet_s=1.5,
                          max_tokens=8, log_dir=tmp_path)
    print(res.model_dump_json(indent=2))
    assert res.pushes == 10
    assert res.failed == 0, res.errors
    assert res.during_push.requests >= 10, "the load must really overlap the pushes"
    assert res.quiet.requests >= 10
    assert set(res.engine_versions.values()) == {res.final_version}


def test_percentile_and_labels() -> None:
    bench = load_bench()
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench.percentile([float(i) for i in range(101)], 99) == 99.0
    reqs = [bench.Request(start=0, end=0.1, ok=True), bench.Request(start=0, end=0.3, ok=False, error="x")]
    s = bench.stats(reqs)
    assert (s.requests, s.failed, s.p50_ms) == (2, 1, 100.0)
