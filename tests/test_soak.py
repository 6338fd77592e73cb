"""The short soak (issue 9, "Load"): agents play whole episodes for a while as weights are pushed;
no error, every acknowledged reward in the store, memory that does not run away. The long version
is ``tools/bench_soak.py`` (its numbers go in the notes, not in assertions on timing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._tools_helpers import load_tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def load_soak():
    return load_tool("bench_soak.py")


def test_short_soak(tiny_model_path: Path, tmp_path: Path) -> None:
    soak = load_soak()
    res = soak.run_soak(str(tiny_model_path), engines=2, agents=4, duration_s=40, push_every_s=4,
                        sample_every_s=1.0, log_dir=tmp_path, window_s=20)
    print(res.model_dump_json(indent=2))
    assert res.errors == 0, res.error_samples
    assert res.push_errors == [] and res.pushes >= 5 and res.episodes >= 40  # pushes that completed
    assert res.rewards_in_store == res.rewards_acknowledged == res.episodes
    for m in res.memory:  # a leak of even a few KB per episode would show as tens of MB here
        assert m.growth_mb < 40, m
    assert len(res.windows) == 2 and sum(w.episodes for w in res.windows) == res.episodes
    assert all(set(w.rss_mb) == {"gateway", "engine0", "engine1"} for w in res.windows)


def test_memory_series_and_percentiles() -> None:
    soak = load_soak()
    flat = soak.series("x", [(t, 100.0 + (t % 2)) for t in range(30)])
    assert abs(flat.growth_mb) < 1 and abs(flat.slope_mb_per_min) < 2
    leak = soak.series("x", [(t, 100.0 + t) for t in range(30)])
    assert leak.growth_mb == 20 and leak.slope_mb_per_min == 60
    assert soak.percentile([5.0, 1.0, 3.0], 50) == 3.0


def test_windows_split_episodes_latency_and_memory_by_time() -> None:
    soak = load_soak()
    eps = [soak.Episode(start=100.0 + t, end=101.0 + t, turn_ms=[10.0 * (1 + t // 10)], ok=t != 15)
           for t in range(20)]
    mem = {"gateway": [(t, 50.0 + (t >= 10) * 4) for t in range(20)]}
    first, second = soak.windows(eps, 100.0, 20.0, 10.0, mem)
    assert (first.episodes, first.errors, first.turn_p50_ms, first.rss_mb) == (10, 0, 10.0, {"gateway": 50.0})
    assert (second.episodes, second.errors, second.turn_p50_ms, second.rss_mb) == (10, 1, 20.0, {"gateway": 54.0})
    assert soak.growth_after_warmup({"g": [(t, 100.0 + t / 60) for t in range(0, 1200, 2)]}, 300) == {"g": 10.0}
