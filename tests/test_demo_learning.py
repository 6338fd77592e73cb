"""The learning demo, shortened, as a real subprocess: warm start (SFT through Megatron), an RL job
through the whole stack, held-out success before vs after, a PNG plot. The margin is asserted on a
held-out set sampled with fixed seeds: a real improvement, not a tuned constant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_engines import CLI

from slime_server.utils.eval_args import parse_eval_data
from slime_server.utils.procs import kill_group

pytestmark = pytest.mark.timeout(3000)


def test_eval_data_flag_is_checked(tmp_path: Path) -> None:
    f = tmp_path / "e.jsonl"
    f.write_text('{"prompt": "What is 2 + 3?", "label": "5"}\n')
    assert parse_eval_data([f"mine={f}"]) == [("mine", str(f))]
    with pytest.raises(SystemExit, match="NAME=PATH"):
        parse_eval_data(["nonsense"])
    with pytest.raises(SystemExit, match="not a file"):
        parse_eval_data([f"x={tmp_path / 'missing.jsonl'}"])


def test_serve_eval_data_fills_jobs_without_eval_sets(tmp_path: Path) -> None:
    from slime_server.buffer.job_store import SQLiteJobStore
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.jobs.manager import JobManager
    from slime_server.jobs.spec import JobSpec

    f = tmp_path / "e.jsonl"
    f.write_text('{"prompt": "What is 2 + 3?", "label": "5"}\n')
    db = tmp_path / "s.db"
    manager = JobManager(SQLiteTrajectoryStore(db), SQLiteJobStore(db), lambda spec: None, list, tmp_path,
                         default_evals=[("mine", str(f))])
    dataset_job = JobSpec.model_validate({"data": {"source": "dataset", "environment": "calculator"}})
    filled = manager.with_default_evals(dataset_job)
    assert [(e.name, e.environment, e.dataset, e.temperature) for e in filled.eval] == [
        ("mine", "calculator", str(f), 0.0)]
    own = dataset_job.model_copy(update={"eval": [filled.eval[0].model_copy(update={"name": "own"})]})
    assert [e.name for e in manager.with_default_evals(own).eval] == ["own"]  # a job's own sets win
    assert manager.with_default_evals(JobSpec()).eval == []  # a live job has no environment to play them


def test_shortened_demo_learns(tiny_model_path: Path, tmp_path: Path) -> None:
    eval_file = tmp_path / "extra.jsonl"
    eval_file.write_text('{"prompt": "Ana has 4 apples and buys 3 more. How many apples does Ana have now?", '
                         '"label": "7"}\n')
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [str(CLI), "demo", "--steps", "40", "--eval-every", "20", "--eval-prompts", "256", "--seed", "0", "--exit",
         "--work-dir", str(work), "--eval-data", f"extra={eval_file}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=2900)  # ~17 min here; CI machines have run it ~1.7x slower
    finally:
        kill_group(proc)
    sys.stdout.write(out[-3000:])
    assert proc.returncode == 0
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("[demo] summary: "))
                         .removeprefix("[demo] summary: "))
    curve = summary["curve"]
    assert [s for s, _ in curve] == [0, 20, 40]
    # async RL is not bit-reproducible, and 30 steps gave +21, +5.5 and passes of >= +10 points in four
    # runs: 40 steps and 256 held-out problems (same seeded samples before and after) for a margin of 5
    assert summary["success_after"] - summary["success_before"] >= 0.05, summary
    assert {name for name, _, _ in summary["other_evals"]} == {"extra"}
    png = Path(summary["plot"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
