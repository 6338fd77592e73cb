"""CPU engine decode under a batch whose members keep changing: requests of different prompt and output lengths,
``--concurrency`` at a time, so sequences leave and join the decode batch at almost every step (an agent
workload's shape). Prints the engine's CPU seconds per run (the whole process's, the scheduler thread's
work being nearly all of it) and the tokens generated; compare two versions of the engine by running this on each.

    python tools/bench_batch_churn.py [--model tiny] [--requests 256] [--concurrency 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
from slime_server.rollout.protocol import SamplingParams


def model_path(name: str) -> str:
    if name == "tiny":
        from slime_server.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    return name


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (built locally) or an HF checkpoint directory")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    args = ap.parse_args(argv)
    engine = CPUEngine(EngineConfig(model_path=model_path(args.model), max_running_requests=args.concurrency,
                                    num_threads=args.threads))
    rng = random.Random(0)
    work = [(list(range(10, 10 + rng.randint(20, 200))), rng.randint(5, 60)) for _ in range(args.requests)]

    def one(item: tuple[list[int], int]) -> int:
        prompt, n = item
        out = engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True))
        return len(out[0].output_ids)

    cpu: list[float] = []
    try:
        for rep in range(args.reps):
            c0, t0 = time.process_time(), time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                tokens = sum(pool.map(one, work))
            cpu.append(time.process_time() - c0)
            print(f"run {rep}: {tokens} tokens in {time.monotonic() - t0:.2f} s, {cpu[-1]:.2f} CPU-s", flush=True)
    finally:
        engine.shutdown()
    return cpu


if __name__ == "__main__":
    main()
