"""Constrained decoding on the CPU engine (issue 42), side by side in one run.

1. Speed: decode tokens/s with a JSON schema vs without, at batch 1 and 8 (n samples of one prompt), each
   generating exactly ``--tokens`` tokens (the schema asks for an array of at least 500 digits, so it cannot end
   sooner; ``ignore_eos`` for the free run). Median of ``--repeats`` runs each, alternated.
2. The log-prob gap: the recorded log-prob of a token decoded under a grammar is that of the masked, renormalised
   distribution; the unmasked policy (what the trainer computes) gives the same token a lower one. Over
   ``--samples`` answers to a JSON-schema request sampled at temperature 1: per token, masked minus unmasked
   (log of 1/Z, Z the allowed tokens' probability mass), and per answer, the sum (the log of the sequence's
   importance ratio that TIS would see).

    python tools/bench_grammar.py --model smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig  # noqa: E402
from slime_server.rollout.protocol import SamplingParams  # noqa: E402
from slime_server.server.launch import resolve_model_path  # noqa: E402

LONG = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 500})
TRIP = json.dumps({
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 14},
                   "plan": {"type": "object", "properties": {"mode": {"enum": ["bus", "train"]},
                                                             "stops": {"type": "array", "maxItems": 3,
                                                                       "items": {"type": "integer"}}},
                            "required": ["mode", "stops"], "additionalProperties": False}},
    "required": ["city", "days", "plan"], "additionalProperties": False})


def speed(engine: CPUEngine, prompt: list[int], tokens: int, batch: int, repeats: int) -> dict[str, float]:
    free = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True, n=batch, sampling_seed=1)
    constrained = free.model_copy(update={"json_schema": LONG})
    engine.generate(prompt, constrained)  # compile (cached from here on) and warm up
    times: dict[str, list[float]] = {"free": [], "json_schema": []}
    for _ in range(repeats):
        for name, params in (("free", free), ("json_schema", constrained)):
            t0 = time.perf_counter()
            outs = engine.generate(prompt, params)
            times[name].append(time.perf_counter() - t0)
            assert all(len(o.output_ids) == tokens for o in outs), [len(o.output_ids) for o in outs]
    return {name: batch * tokens / statistics.median(t) for name, t in times.items()}


def logz_gap(engine: CPUEngine, prompt: list[int], samples: int) -> tuple[list[float], list[float]]:
    outs = engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=200, n=samples, sampling_seed=0,
                                                  json_schema=TRIP), return_logprob=True)
    per_token, per_answer = [], []
    for o in outs:
        masked = [lp for lp, _, _ in o.meta_info.output_token_logprobs]
        (ref,) = engine.generate(prompt + o.output_ids, SamplingParams(temperature=1.0, max_new_tokens=0),
                                 return_logprob=True, logprob_start_len=len(prompt))
        unmasked = [lp for lp, _, _ in ref.meta_info.input_token_logprobs][-len(masked):]
        gaps = [m - u for m, u in zip(masked, unmasked, strict=True)]
        per_token += gaps
        per_answer.append(sum(gaps))
    return per_token, per_answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2 or an HF directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    engine = CPUEngine(EngineConfig(model_path=path, num_threads=args.threads))
    try:
        tok = engine.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": "Plan a short trip and answer in JSON."}],
                                       add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        print(f"model {args.model}, {args.threads} threads, {args.tokens} tokens per sample, median of "
              f"{args.repeats}")
        for batch in (1, 8):
            r = speed(engine, prompt, args.tokens, batch, args.repeats)
            print(f"batch {batch}: free {r['free']:.1f} tok/s, json_schema {r['json_schema']:.1f} tok/s, "
                  f"ratio {r['json_schema'] / r['free']:.2f}")
        per_token, per_answer = logz_gap(engine, prompt, args.samples)
        q = sorted(per_token)
        print(f"log-prob gap, masked - unmasked, over {len(per_token)} tokens of {args.samples} answers: mean "
              f"{statistics.mean(q):.2f}, median {statistics.median(q):.2f}, p90 {q[int(0.9 * len(q))]:.2f}, "
              f"max {q[-1]:.2f} nats; share above 0.1: {sum(x > 0.1 for x in q) / len(q):.0%}")
        print(f"per answer (log of the sequence's ratio): min {min(per_answer):.1f}, median "
              f"{statistics.median(per_answer):.1f}, max {max(per_answer):.1f}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
