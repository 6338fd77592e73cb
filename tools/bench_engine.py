"""Rollout benchmark: generation throughput through the real sgl-router, and bucketed weight push speed.

1. Tokens/s at concurrency 1, 4, 16 through the router with 2 engines and with 1 (the second one
   deregistered from the router at run time), interleaved in one run so the ratios compare like with like.
2. Weight push: pack the served model's tensors into buckets (slime_server.weights), push them to one
   engine through SGLang's ``/update_weights_from_tensor`` (shared-memory path), and compare with a plain memcpy
   of the same number of bytes.

    python tools/bench_engine.py [--model tiny] [--requests-per-level 16] [--max-new-tokens 32] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from slime_server.config import EngineSettings, RaySettings, RouterSettings, ServerSettings
from slime_server.server.launch import Deployment


class LevelResult(BaseModel):
    engines: int
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


class PushResult(BaseModel):
    total_bytes: int
    buckets: int
    pack_s: float
    push_s: float
    memcpy_s: float


async def _one(client: httpx.AsyncClient, url: str, prompt_len: int, max_new: int, vocab: int) -> int:
    body = {
        "input_ids": [random.randrange(10, vocab) for _ in range(prompt_len)],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True},
        "return_logprob": True,
    }
    r = await client.post(f"{url}/generate", json=body)
    r.raise_for_status()
    return len(r.json()["output_ids"])


async def _level(url: str, concurrency: int, n_requests: int, prompt_len: int, max_new: int, vocab: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)

    async def guarded(client: httpx.AsyncClient) -> int:
        async with sem:
            return await _one(client, url, prompt_len, max_new, vocab)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, url, prompt_len, 4, vocab)  # warm the path
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(guarded(client) for _ in range(n_requests)))
        return sum(counts), time.perf_counter() - t0


def bench_throughput(dep: Deployment, levels: list[int], n_requests: int, prompt_len: int,
                     max_new: int, vocab: int, repeats: int) -> list[LevelResult]:
    """Interleave 2-engine and 1-engine runs per level (best of ``repeats``) so machine noise hits both.

    "1 engine" = the second engine deregistered from the router (cheap, no restart), then re-added.
    """
    spare = dep.engine_urls[1]
    best: dict[tuple[int, int], LevelResult] = {}
    for c in levels:
        n = max(n_requests, 4 * c)  # several waves, so the top level is not one lucky batch
        for _ in range(repeats):
            for engines in (2, 1):
                if engines == 1:
                    dep.router.remove_worker(spare)
                toks, secs = asyncio.run(_level(dep.router_url, c, n, prompt_len, max_new, vocab))
                if engines == 1:
                    dep.router.add_worker(spare)
                res = LevelResult(engines=engines, concurrency=c, requests=n, output_tokens=toks, seconds=secs)
                if (engines, c) not in best or res.tokens_per_s > best[(engines, c)].tokens_per_s:
                    best[(engines, c)] = res
        for engines in (2, 1):
            r = best[(engines, c)]
            print(f"engines={engines} concurrency={c:>2} requests={r.requests:>3} tokens={r.output_tokens:>5} "
                  f"best time={r.seconds:6.2f}s  {r.tokens_per_s:8.1f} tok/s", flush=True)
    return list(best.values())


def bench_push(engine_url: str, model_path: str, bucket_bytes: int, repeats: int = 3) -> PushResult:
    """Push the model's own weights back to a live engine through SGLang's tensor route (the trainer's
    ``WeightPusher``, same-host shared memory); compare with memcpy of the same bytes (best of N)."""
    import torch
    from transformers import AutoModelForCausalLM

    from slime_server.trainer.weight_push import WeightPusher

    named = list(AutoModelForCausalLM.from_pretrained(model_path).state_dict().items())
    total = sum(t.numel() * t.element_size() for _, t in named)
    pack_s = push_s = float("inf")
    buckets = 0
    with WeightPusher([engine_url], bucket_bytes=bucket_bytes, mode="tensor", sender=True) as pusher:
        for rep in range(repeats):
            stats = pusher.push(iter(named), version=f"bench-{rep}")
            pack_s, push_s, buckets = min(pack_s, stats.pack_seconds), min(push_s, stats.seconds), stats.buckets
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    memcpy_s = float("inf")
    for _ in range(repeats + 2):  # the first copy also faults the pages in
        t0 = time.perf_counter()
        dst.copy_(src)
        memcpy_s = min(memcpy_s, time.perf_counter() - t0)
    return PushResult(total_bytes=total, buckets=buckets, pack_s=pack_s, push_s=push_s, memcpy_s=memcpy_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="runs per (level, engines); the best counts")
    ap.add_argument("--bucket-mib", type=float, default=4.0)
    ap.add_argument("--skip-push", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    import torch

    torch.set_num_threads(1)  # the client side stays light; engines get their own threads
    settings = ServerSettings(
        engine=EngineSettings(model=args.model, num_engines=2, torch_threads=args.torch_threads,
                              num_cpus_per_engine=0.5, max_running_requests=max(levels)),
        router=RouterSettings(policy="round_robin"),
        ray=RaySettings(num_cpus=2),
    )
    report: dict[str, Any] = {}
    dep = Deployment.start(settings)
    try:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(dep.model_path).vocab_size
        if not args.skip_throughput:
            res = bench_throughput(dep, levels, args.requests_per_level, args.prompt_len, args.max_new_tokens,
                                   vocab, args.repeats)
            report["throughput"] = [r.model_dump() | {"tokens_per_s": r.tokens_per_s} for r in res]
            by = {(r.engines, r.concurrency): r.tokens_per_s for r in res}
            for c in levels:
                print(f"concurrency {c:>2}: 2 engines / 1 engine = {by[(2, c)] / by[(1, c)]:.2f}x")
            for e in (2, 1):
                print(f"{e} engine(s): c={levels[-1]} / c={levels[0]} = "
                      f"{by[(e, levels[-1])] / by[(e, levels[0])]:.2f}x")
        if not args.skip_push:
            push = bench_push(dep.engine_urls[0], dep.model_path, int(args.bucket_mib * 2**20))
            report["push"] = push.model_dump()
            mb = push.total_bytes / 2**20
            print(f"weight push: {mb:.1f} MiB in {push.buckets} buckets: pack {push.pack_s * 1e3:.1f} ms, "
                  f"push {push.push_s * 1e3:.1f} ms ({mb / push.push_s:.0f} MiB/s); memcpy "
                  f"{push.memcpy_s * 1e3:.2f} ms ({mb / push.memcpy_s:.0f} MiB/s); push/memcpy throughput "
                  f"= {push.memcpy_s / push.push_s:.1%} (pack+push: {push.memcpy_s / (push.pack_s + push.push_s):.1%})")
    finally:
        dep.shutdown()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
