"""Decode speed of the CPU engine, side by side in one run: its own forward (``lean``, the default), HF's
``model()`` inside the same engine (``hf``: what the engine did before), HF ``generate`` on a static
batch, and llama.cpp on the same weights when ``--gguf`` is given (``pip install llama-cpp-python``
for the benchmark only; its source carries ``convert_hf_to_gguf.py`` to make F32/BF16 GGUFs).

Greedy, EOS ignored, prefill excluded: each rate is (tokens of an N-token run - tokens of a 1-token run)
/ (time of the N-token run - time of the 1-token run), best of ``--repeats``, the variants interleaved
per repeat so machine noise hits all of them.

    python tools/bench_decode.py --model smollm2 --levels 1,8,32 --new-tokens 64 [--gguf model-f32.gguf]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def engine_run(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    from slime_server.rollout.protocol import SamplingParams

    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:  # submitted together: decoded as one batch
        list(pool.map(lambda p: engine.generate(p, sp), prompts))
    return time.perf_counter() - t0


def hf_run(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def llamacpp_run(llm: Any, prompt: list[int], new_tokens: int) -> float:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    for _ in range(new_tokens):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    return time.perf_counter() - t0


def decode_rate(run: Any, n_seqs: int, new_tokens: int) -> float:
    full, one = run(new_tokens), run(1)
    return n_seqs * (new_tokens - 1) / max(full - one, 1e-9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | an HF directory")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also the lean engine in bfloat16")
    ap.add_argument("--gguf", default=None, help="llama.cpp model of the same weights (batch 1 only)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
    from slime_server.server.launch import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    levels = [int(x) for x in args.levels.split(",")]
    kinds = {"lean": ("lean", "float32"), "hf": ("hf", "float32"), "lean-bf16": ("lean", "bfloat16")}
    engines = {name: CPUEngine(EngineConfig(model_path=path, max_running_requests=max(levels), num_threads=args.threads,
                                            forward=fwd, dtype=dtype, prefix_cache_mb=0))
               for name, (fwd, dtype) in kinds.items() if name != "lean-bf16" or args.bf16}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    llm = None
    if args.gguf:
        from llama_cpp import Llama

        llm = Llama(model_path=args.gguf, n_threads=args.threads, n_ctx=args.prompt_len + args.new_tokens + 8,
                    verbose=False, logits_all=False)
    best: dict[str, float] = {}
    try:
        for c in levels:
            prompts = _prompts(vocab, c, args.prompt_len, seed=c)
            variants: dict[str, Any] = {
                f"engine-lean c={c}": lambda n, p=prompts: engine_run(engines["lean"], p, n),
                f"engine-hf c={c}": lambda n, p=prompts: engine_run(engines["hf"], p, n),
                f"hf-static c={c}": lambda n, p=prompts: hf_run(hf, p, n),
            }
            if "lean-bf16" in engines:
                variants[f"engine-lean-bf16 c={c}"] = lambda n, p=prompts: engine_run(engines["lean-bf16"], p, n)
            if llm is not None and c == 1:
                variants[f"llama.cpp c={c}"] = lambda n, p=prompts[0]: llamacpp_run(llm, p, n)
            for run in variants.values():
                run(2)  # warm up
            for _ in range(args.repeats):
                for name, run in variants.items():
                    best[name] = max(best.get(name, 0.0), decode_rate(run, c, args.new_tokens))
            for name in variants:
                print(f"{name:<22} {best[name]:8.1f} tok/s", flush=True)
            base = best[f"hf-static c={c}"]
            print(f"c={c}: lean / HF static = {best[f'engine-lean c={c}'] / base:.2f}x, "
                  f"lean / engine-hf = {best[f'engine-lean c={c}'] / best[f'engine-hf c={c}']:.2f}x"
                  + (f", lean / llama.cpp = {best[f'engine-lean c={c}'] / best[f'llama.cpp c={c}']:.2f}x"
                     if f"llama.cpp c={c}" in best else ""), flush=True)
        if len(levels) > 1:
            print(f"lean c={levels[-1]} / lean c={levels[0]} = "
                  f"{best[f'engine-lean c={levels[-1]}'] / best[f'engine-lean c={levels[0]}']:.2f}x")
    finally:
        for e in engines.values():
            e.shutdown()
    if args.json:
        args.json.write_text(json.dumps(best, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
