"""The learning demo, shortened, as a real subprocess: warm start (SFT through Megatron), an RL job
through the whole stack, held-out success before vs after, a PNG plot. The margin is asserted on a
held-out set sampled with fixed seeds: a real improvement, not a tuned constant."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_server.utils.eval_args import parse_eval_data
from tests._cli_helpers import run_demo

pytestmark = pytest.mark.timeout(3000)


def test_eval_data_flag_is_checked(tmp_path: Path) -> None:
    f = tmp_path / "e.jsonl"
    f.write_text('{"prompt": "What is 2 + 3?", "label": "5"}\n')
    assert parse_eval_data([f"mine={f}"]) == [("mine", str(f))]
    with pytest.raises(SystemExit, match="NAME=PATH"):
        parse_eval_data(["nonsense"])
    with pytest.raises(SystemExit, match="not a file"):
        parse_eval_data([f"x={tmp_path / 'missing.jsonl'}"])


def test_demo_flags_set_the_warm_start_and_rl_settings() -> None:
    """--sft-seed is another warm start (its SFT settings, hence its cache key, differ); the other flags land
    where they say; no flag leaves the defaults the demo's measurements were made at."""
    import argparse

    from slime_server.demo import DemoCommand

    parser = argparse.ArgumentParser()
    DemoCommand().add_arguments(parser)
    cmd = DemoCommand()
    default = cmd.learning_settings(parser.parse_args([]))
    assert (default.sft.seed, default.sft.steps, default.rl_steps, default.lr) == (0, 400, 40, 1e-4)
    set_ = cmd.learning_settings(parser.parse_args(["--sft-seed", "3", "--sft-lr", "5e-4", "--sft-steps", "7",
                                                     "--steps", "9", "--lr", "2e-5", "--seed", "4"]))
    assert (set_.sft.seed, set_.sft.lr, set_.sft.steps, set_.rl_steps, set_.lr, set_.seed) == (3, 5e-4, 7, 9, 2e-5, 4)
    assert set_.sft.model_dump_json() != default.sft.model_dump_json()


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


def test_the_held_out_set_shares_no_problem_with_training() -> None:
    """No held-out problem's (template, operands) is in the warm start's data or RL's, whatever the seed."""
    from slime_server.demo_learning import DEMO_TEMPLATES, demo_rows, operand_pairs, warm_start_conversations

    ops = {expr.split()[1]: i for i, (_, expr) in enumerate(DEMO_TEMPLATES)}

    def problem(expression: str, operator: str | None = None) -> tuple[int, int, int]:
        a, op, b = expression.split()
        return ops[operator or op], int(a), int(b)

    held = demo_rows(256, 200, "held_out")
    assert len({r.prompt for r in held}) == 256  # distinct problems
    held_problems = {problem(str(r.metadata["expression"])) for r in held}
    rl = {problem(str(r.metadata["expression"])) for seed in range(5) for r in demo_rows(512, seed + 100)}
    # the sloppy teacher may call the wrong operator: the problem is the one the user message states
    sft_rows = demo_rows(4000, 1, "train")
    sft = warm_start_conversations(4000)
    assert [c[1]["content"] for c in sft] == [r.prompt for r in sft_rows]
    sft_problems = {problem(str(r.metadata["expression"])) for r in sft_rows}
    assert not held_problems & rl and not held_problems & sft_problems
    for t in range(3):
        assert len(operand_pairs("held_out", t)) == 16
        assert {(a, b) for (u, a, b) in held_problems if u == t} <= set(operand_pairs("held_out", t))
    seen_pairs = {(a, b) for _, a, b in sft_problems}
    assert len(seen_pairs) == 64  # every operand pair is trained on, with some other template
    assert not {r.prompt for r in held} & {c[1]["content"] for c in sft}
    with pytest.raises(ValueError, match="272 distinct problems"):
        demo_rows(300, 0, "held_out")


def test_the_example_datasets_are_the_demos_problems() -> None:
    """examples/grpo_calculator.yaml trains on the demo's problems, which its warm start (tiny-calc) knows."""
    from slime_server.demo_learning import demo_rows

    data = Path(__file__).resolve().parents[1] / "examples" / "data"
    assert (data / "calculator_train.jsonl").read_text() == "".join(r.model_dump_json() + "\n"
                                                                     for r in demo_rows(512, 100))
    assert (data / "calculator_heldout.jsonl").read_text() == "".join(r.model_dump_json() + "\n"
                                                                       for r in demo_rows(64, 200, "held_out"))


def test_shortened_demo_learns(tiny_model_path: Path, tmp_path: Path) -> None:
    eval_file = tmp_path / "extra.jsonl"
    eval_file.write_text('{"prompt": "Ana has 4 apples and buys 3 more. How many apples does Ana have now?", '
                         '"label": "7"}\n')
    summary = run_demo(["--steps", "40", "--eval-every", "40", "--eval-prompts", "256", "--seed", "0", "--exit",
                        "--work-dir", str(tmp_path / "work"), "--eval-data", f"extra={eval_file}"],
                       timeout=2900)  # ~3 min with the warm start cached, ~13 building it
    curve = summary["curve"]
    assert [s for s, _ in curve] == [0, 40]
    # the margin: the demo's gain must stand clear of the measurement's own noise. The same weights (the step-0
    # evaluation of four runs of this warm start, same seeds) measured 42.2, 44.1, 44.5 and 45.3%: batching differs
    # from run to run (sd 1.3 points), so three standard deviations of a difference of two measurements is 5.6
    # points. Gains measured (tools/bench_demo.py's settings): idle, seeds 0-5 (2026-11-26), +16.0 to +35.5; seed 0
    # under load, as CI runs it beside two other test workers, (2026-11-28, three demos at once, and one inside the
    # suite with another process beside it) +12.9, +14.5, +21.1 and +6.6; a CI run once +9 (another warm start):
    # the asynchronous loop learns less in its 40 steps when the cores are shared (why, not measured). Those runs also
    # evaluated at step 20; this test no longer does (one evaluation of 256 problems less): idle, seed 0, +17.2.
    assert summary["success_after"] - summary["success_before"] >= 0.06, summary
    assert {name for name, _, _ in summary["other_evals"]} == {"extra"}
    png = Path(summary["plot"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
