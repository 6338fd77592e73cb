"""LoRA serving benchmark (issue 43): 8 concurrent requests on 8 different adapters against 8 on the base, one
engine, side by side in one run (rounds alternate base / adapters so drift hits both alike).

The engine is the CPU engine in process (``CPUEngine``, serve's defaults otherwise), the model SmolLM2-135M-Instruct
from the registry, the adapters random rank-``--rank`` PEFT directories on every projection (written with PEFT's
names, loaded through ``--lora-paths``). Greedy, EOS ignored, ``--new`` tokens per request.

    python tools/bench_lora.py [--rank 16] [--adapters 8] [--new 64] [--rounds 3] [--threads 2] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from slime_server.lora_format import CONFIG_FILE, PROJECTIONS, WEIGHTS_FILE, projection_shapes, tensor_name
from slime_server.models.registry import fetch_model
from slime_server.rollout.cpu_engine import CPUEngine
from slime_server.rollout.engine_config import EngineConfig
from slime_server.rollout.protocol import SamplingParams


def write_adapter(out: Path, config: object, rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory on every projection of ``config``'s layers."""
    h = config.hidden_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    shapes = projection_shapes(h, config.num_attention_heads * d, config.num_key_value_heads * d,
                               config.intermediate_size)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for p in PROJECTIONS:
            o, n = shapes[p]
            tensors[tensor_name(layer, p, "A")] = torch.randn(rank, n, generator=gen) * 0.02
            tensors[tensor_name(layer, p, "B")] = torch.randn(o, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                               "target_modules": list(PROJECTIONS)}))
    return out


def run_batch(engine: CPUEngine, loras: list[object], new: int, prompt_len: int) -> float:
    """Output tokens per second of ``len(loras)`` requests submitted together."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    seqs = [engine.new_sequences([100 + (7 * k + j) % 3000 for j in range(prompt_len)], params, lora=lora)[0]
            for k, lora in enumerate(loras)]
    start = time.perf_counter()
    for s in seqs:
        engine.submit(s)
    for s in seqs:
        s.done.wait(600)
    elapsed = time.perf_counter() - start
    return sum(len(s.output_ids) for s in seqs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoConfig

    path = fetch_model("smollm2")
    config = AutoConfig.from_pretrained(str(path))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_adapter(Path(tmp) / f"a{k}", config, args.rank, k) for k in range(args.adapters)]
        engine = CPUEngine(EngineConfig(
            model_path=str(path), num_threads=args.threads, enable_lora=True, max_lora_rank=args.rank,
            max_loras_per_batch=args.adapters + 1, lora_paths=[f"a{k}={d}" for k, d in enumerate(dirs)]))
        try:
            adapters = [engine.adapters.resolve(f"a{k}") for k in range(args.adapters)]
            run_batch(engine, [None] * args.adapters, 8, args.prompt)  # warm up both paths
            run_batch(engine, adapters, 8, args.prompt)
            base, lora = [], []
            for _ in range(args.rounds):
                base.append(run_batch(engine, [None] * args.adapters, args.new, args.prompt))
                lora.append(run_batch(engine, adapters, args.new, args.prompt))
        finally:
            engine.shutdown()
    ratios = [b2 / b1 for b1, b2 in zip(base, lora, strict=True)]
    result = {"threads": args.threads, "rank": args.rank, "adapters": args.adapters, "new_tokens": args.new,
              "base_tok_s": base, "lora_tok_s": lora, "ratio": ratios,
              "ratio_median": statistics.median(ratios), "torch": torch.__version__}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
