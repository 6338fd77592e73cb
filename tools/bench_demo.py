"""The learning demo over several seeds: held-out success before, midway and after, and the spread of the gain.

One demo run is one draw: async RL is not bit-reproducible and the seed picks the training problems, the
sampled episodes and the evaluation's samples. A claim about what the demo learns (README, the margin of
``tests/test_demo_learning.py``) is read from this table, never from one run. Each seed runs
``slime-server demo --exit`` in a fresh process and work directory; the warm start is built by the first
and cached for the others (its key does not include the seed).

    python tools/bench_demo.py --seeds 0 1 2 3 4 5 --steps 40 --eval-every 20 --eval-prompts 256
    python tools/bench_demo.py --vision --seeds 0 1 2 3 --steps 30 --eval-every 10 --eval-prompts 128

The warm start is a draw too: it is rebuilt whenever its inputs change, or its SFT's rounding does (the cache
is keyed by inputs, not by the trainer's code). ``--sft-seeds 0 1 2`` runs every seed on each of those warm
starts (another SFT batch order each) and reports the spread per warm start and over all runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

CLI = Path(sys.executable).with_name("slime-server")


class SeedRun(BaseModel):
    seed: int
    sft_seed: int = 0
    ok: bool
    seconds: float
    curve: list[tuple[int, float]] = []
    error: str | None = None


def run_seed(seed: int, args: argparse.Namespace, work: Path, sft_seed: int = 0) -> SeedRun:
    cmd = [str(CLI), "demo", "--exit", "--seed", str(seed), "--sft-seed", str(sft_seed), "--steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--eval-prompts", str(args.eval_prompts), "--work-dir", str(work)]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if args.vision:
        cmd.append("--vision")
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.monotonic() - t0
    (work / "demo.log").write_text(proc.stdout + proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("[demo] summary: ")), None)
    if proc.returncode != 0 or line is None:
        return SeedRun(seed=seed, sft_seed=sft_seed, ok=False, seconds=seconds, error=(proc.stdout + proc.stderr)[-500:])
    summary = json.loads(line.removeprefix("[demo] summary: "))
    return SeedRun(seed=seed, sft_seed=sft_seed, ok=True, seconds=seconds,
                   curve=[(int(s), float(v)) for s, v in summary["curve"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--sft-seeds", type=int, nargs="+", default=[0], help="one warm start per SFT seed")
    parser.add_argument("--vision", action="store_true", help="the visual demo (demo --vision): the tiny VLM on "
                        "shapes; e.g. --vision --steps 30 --eval-every 10 --eval-prompts 128")
    parser.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-demo-"))
    runs = []
    for sft_seed in args.sft_seeds:
        for seed in args.seeds:
            run = run_seed(seed, args, root / f"sft{sft_seed}-seed{seed}", sft_seed)
            runs.append(run)
            points = "  ".join(f"step {s}: {v:.0%}" for s, v in run.curve)
            print(f"warm start {sft_seed}, seed {seed}: {'ok' if run.ok else 'FAILED'} in {run.seconds:.0f} s  "
                  f"{points}", flush=True)
    ok = [r for r in runs if r.ok]
    groups = [(f"warm start {w}", [r for r in ok if r.sft_seed == w]) for w in args.sft_seeds]
    if len(args.sft_seeds) > 1:
        groups.append(("all warm starts", ok))
    for label, group in groups:
        for step in sorted({s for r in group for s, _ in r.curve} - {0}):
            gains = [100 * (dict(r.curve)[step] - r.curve[0][1]) for r in group if step in dict(r.curve)]
            print(f"{label}: gain at step {step} (points, {len(gains)} runs): min {min(gains):+.1f}  median "
                  f"{statistics.median(gains):+.1f}  max {max(gains):+.1f}  all {[round(g, 1) for g in gains]}")
    print(f"{len(runs) - len(ok)} of {len(runs)} runs failed; logs under {root}")
    if args.out:
        args.out.write_text(json.dumps([r.model_dump() for r in runs], indent=1))


if __name__ == "__main__":
    main()
