"""One thread or torch's team for a gemv.c call: wall and CPU time per call, side by side, under each OpenMP wait
policy (``gemv.SOLO_MACS`` is set from these). Each policy runs in a process of its own: libgomp reads
``OMP_WAIT_POLICY`` once, when torch is imported.

    .venv/bin/python tools/bench_gemv_threads.py                 # the tiny model's and SmolLM2's decode matmuls
    .venv/bin/python tools/bench_gemv_threads.py --rows 1 --shapes 512x256 --policies passive
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from slime_server.rollout.gemv import solo_macs

# (n, k) of each decode matmul: fused qkv, o, fused gate|up, down, the logits
SHAPES = {"tiny": ["512x256", "256x256", "1536x256", "256x768", "1152x256"],
          "smollm2": ["960x576", "576x576", "3072x576", "576x1536", "49152x576"]}


def _measure(rows: list[int], shapes: list[str], team: int, budget: float) -> list[dict]:
    """In this process: per shape and row count, mean wall and CPU microseconds per call on 1 and ``team``
    threads (interleaved rounds: one machine's drift lands on both)."""
    import torch

    from slime_server.rollout import gemv

    kernel = gemv.kernel(torch.float32)
    if kernel is None:
        raise SystemExit("no gemv.c build on this machine (no C compiler?)")
    gemv.SOLO_MACS = 0  # the thread count is what this sets, not the threshold
    out = []
    for m in rows:
        for shape in shapes:
            n, k = map(int, shape.split("x"))
            w, x = torch.randn(n, k), torch.randn(m, k)
            reps = max(20, int(budget / (n * k * max(m, 4))))
            times: dict[int, list[float]] = {1: [0.0, 0.0], team: [0.0, 0.0]}
            for _ in range(3):
                for threads in (1, team):
                    torch.set_num_threads(threads)
                    for _ in range(5):
                        kernel(x, w)
                    c0, t0 = time.process_time(), time.perf_counter()
                    for _ in range(reps):
                        kernel(x, w)
                    times[threads][0] += time.perf_counter() - t0
                    times[threads][1] += time.process_time() - c0
            calls = 3 * reps
            out.append({"rows": m, "shape": shape, "macs": m * n * k,
                        "solo_us": [t * 1e6 / calls for t in times[1]],
                        "team_us": [t * 1e6 / calls for t in times[team]]})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=SHAPES["tiny"] + SHAPES["smollm2"])
    ap.add_argument("--policies", nargs="+", default=["passive", "default"], choices=["passive", "active", "default"],
                    help="OMP_WAIT_POLICY for each run (default: unset)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the team's size")
    ap.add_argument("--budget", type=float, default=2e8, help="multiply-adds per timed round (sets repetitions)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads < 2:
        ap.error("--threads: a team is 2 threads or more (one is what it is compared with)")
    if args.child:
        print(json.dumps(_measure(args.rows, args.shapes, args.threads, args.budget)))
        return []
    results = []
    for policy in args.policies:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy != "default":
            env["OMP_WAIT_POLICY"] = policy.upper()
        cmd = [sys.executable, __file__, "--child", "--rows", *map(str, args.rows), "--shapes", *args.shapes,
               "--threads", str(args.threads), "--budget", str(args.budget)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        rows = json.loads(done.stdout.splitlines()[-1])
        threshold = solo_macs(None if policy == "default" else policy)
        print(f"OMP_WAIT_POLICY={policy} (one thread below {threshold:,} multiply-adds), team of {args.threads}:")
        print(f"{'rows':>4} {'matrix':>10} {'MACs':>11} | {'1 thread: wall':>14} {'cpu':>8} | {'team: wall':>10} "
              f"{'cpu':>8} us | chosen")
        for r in rows:
            chosen = "1" if r["macs"] < threshold else "team"
            print(f"{r['rows']:>4} {r['shape']:>10} {r['macs']:>11,} | {r['solo_us'][0]:>14.1f} {r['solo_us'][1]:>8.1f} "
                  f"| {r['team_us'][0]:>10.1f} {r['team_us'][1]:>8.1f}    | {chosen}")
            results.append({"policy": policy, **r})
    return results


if __name__ == "__main__":
    main()
