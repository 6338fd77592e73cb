"""How far the CPU engine's bf16 mode is from fp32: the log-probs a bf16 engine reports for its own greedy
tokens against an fp32 HF forward over the same tokens (|d logprob| mean, p95, max), and how many of its
greedy tokens the fp32 engine also picks. A measurement (the bound ARCHITECTURE.md states), not a test.

    python tools/bench_bf16_distance.py --model smollm2 [--decode-kernel c|torch] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="tiny | smollm2 | an HF directory")
    ap.add_argument("--decode-kernel", choices=["c", "torch"], default="c")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
    from slime_server.rollout.protocol import SamplingParams
    from slime_server.server.launch import resolve_model_path

    path = resolve_model_path(args.model)
    engines = {dtype: CPUEngine(EngineConfig(model_path=path, dtype=dtype, num_threads=args.threads, prefix_cache_mb=0,
                                             decode_kernel=args.decode_kernel)) for dtype in ("bfloat16", "float32")}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, hf.config.vocab_size) for _ in range(n)] for n in (5, 9, 12, 30, 40, 60)]
    sp = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    diffs: list[float] = []
    same = total = 0
    try:
        for p in prompts:
            low = engines["bfloat16"].generate(p, sp, return_logprob=True)[0]
            full = engines["float32"].generate(p, sp)[0]
            ids = low.output_ids
            with torch.no_grad():
                logits = hf(torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
            diffs += [abs(lp - r) for (lp, _, _), r in zip(low.meta_info.output_token_logprobs or [], ref, strict=True)]
            same += sum(a == b for a, b in zip(ids, full.output_ids, strict=True))
            total += len(ids)
    finally:
        for e in engines.values():
            e.shutdown()
    diffs.sort()
    print(f"decode kernel {args.decode_kernel}: |d logprob| mean {statistics.mean(diffs):.4f}, "
          f"p95 {diffs[int(0.95 * len(diffs))]:.4f}, max {diffs[-1]:.4f} nats over {len(diffs)} tokens; "
          f"greedy tokens the fp32 engine also picks: {same}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
