"""LoRA serving benchmark (issue 43): 8 concurrent requests on 8 different adapters against 8 on the base, one
engine, side by side in one run (rounds alternate base / adapters so drift hits both alike).

The engine is the CPU engine in process (``CPUEngine``, serve's defaults otherwise), the model SmolLM2-135M-Instruct
from the registry, the adapters random rank-``--rank`` PEFT directories on every projection (written with PEFT's
names, loaded through ``--lora-paths``). Greedy, EOS ignored, ``--new`` tokens per request.

    python tools/bench_lora.py [--rank 16] [--adapters 8] [--new 64] [--rounds 3] [--threads 2] [--json out]

``--updates SECONDS``: other users' latency while one adapter updates every SECONDS vs no updates. Each of the
adapters' users sends request after request (``--new`` tokens each); in the update phases, user 0's adapter is
loaded again under a new versioned name every SECONDS (``load_tensors``, SGLang's
``/load_lora_adapter_from_tensors`` path after its HTTP and unpickling) and the left version unloaded (it waits for
its requests), as a per-user job publishes; user 0 follows to each new version. Phases of ``--phase`` seconds
alternate (quiet, updates) ``--rounds`` times; the p50 / p99 of the other users' request latencies per kind of
phase, their ratio, and failed requests.
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


def latency_phases(engine: CPUEngine, dirs: list[Path], args: argparse.Namespace) -> dict[str, object]:
    """The ``--updates`` measurement (see the module's docstring)."""
    import threading

    from safetensors.torch import load_file

    params = SamplingParams(max_new_tokens=args.new, temperature=0.0, ignore_eos=True)
    config = json.loads((dirs[0] / CONFIG_FILE).read_text())
    weights = load_file(str(dirs[0] / WEIGHTS_FILE))
    current = ["a0"]  # user 0's adapter name now
    failed: list[str] = []
    latencies: dict[str, list[float]] = {"quiet": [], "updates": []}
    phase = ["quiet"]
    stop = threading.Event()

    def user(k: int) -> None:
        prompt = [100 + (7 * k + j) % 3000 for j in range(args.prompt)]
        while not stop.is_set():
            name, kind = current[0] if k == 0 else f"a{k}", phase[0]
            try:
                seq = engine.new_sequences(prompt, params, lora=engine.adapters.resolve(name))[0]
                t0 = time.perf_counter()
                engine.submit(seq)
                if not seq.done.wait(600):
                    raise TimeoutError("no answer in 600 s")
            except Exception as e:  # noqa: BLE001 - counted
                if k == 0 and name != current[0]:
                    continue  # user 0 raced its own version's unload: it asks the new one (the gateway re-sends)
                failed.append(f"user {k}: {e!r}")
                continue
            if k > 0 and phase[0] == kind:
                latencies[kind].append(time.perf_counter() - t0)

    def updater() -> None:
        version = 0
        while not stop.is_set():
            if phase[0] != "updates":
                time.sleep(0.05)
                continue
            version += 1
            name = f"a0.v{version}"
            engine.adapters.load_tensors(name, config, {k: v * (1 + 0.01 * version) for k, v in weights.items()})
            left, current[0] = current[0], name
            engine.adapters.unload(left)
            stop.wait(args.updates)

    threads = [threading.Thread(target=user, args=(k,), daemon=True) for k in range(args.adapters)]
    threads.append(threading.Thread(target=updater, daemon=True))
    for t in threads:
        t.start()
    for _ in range(args.rounds):
        for kind in ("quiet", "updates"):
            phase[0] = kind
            time.sleep(args.phase)
    stop.set()
    for t in threads:
        t.join(60)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    out: dict[str, object] = {k: {"requests": len(v), "p50_s": pct(v, 0.5), "p99_s": pct(v, 0.99)}
                              for k, v in latencies.items()}
    out["p99_ratio"] = pct(latencies["updates"], 0.99) / pct(latencies["quiet"], 0.99)
    out["p50_ratio"] = pct(latencies["updates"], 0.5) / pct(latencies["quiet"], 0.5)
    out["failed"] = failed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--updates", type=float, default=None, help="seconds between one adapter's updates: measure "
                    "the other users' latency with and without them")
    ap.add_argument("--phase", type=float, default=20.0, help="--updates: seconds of each phase")
    args = ap.parse_args()
    from transformers import AutoConfig

    path = fetch_model("smollm2")
    config = AutoConfig.from_pretrained(str(path))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_adapter(Path(tmp) / f"a{k}", config, args.rank, k) for k in range(args.adapters)]
        engine = CPUEngine(EngineConfig(
            model_path=str(path), num_threads=args.threads, enable_lora=True, max_lora_rank=args.rank,
            max_loras_per_batch=args.adapters + 1, max_loaded_loras=args.adapters + 2,
            lora_paths=[f"a{k}={d}" for k, d in enumerate(dirs)]))
        if args.updates is not None:
            try:
                result = {"threads": args.threads, "rank": args.rank, "adapters": args.adapters,
                          "new_tokens": args.new, "update_every_s": args.updates, "phase_s": args.phase,
                          "rounds": args.rounds, **latency_phases(engine, dirs, args)}
            finally:
                engine.shutdown()
            print(json.dumps(result, indent=2))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2))
            return
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
