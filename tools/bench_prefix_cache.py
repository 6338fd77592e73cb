"""The CPU engine's prefix cache as it fills: a prompt's match and a finished generation's put, against a scan of
every entry (how the cache found its longest prefix before it kept its entries in order), side by side in one run.

Entries share a system prompt (agents of one job do) and differ after it, the case where a scan compared the whole
shared prompt once per entry, on the engine's scheduler thread, between decode steps.

    python tools/bench_prefix_cache.py --entries 100,1000,3000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_server.rollout.prefix_cache import PrefixCache  # noqa: E402
from slime_server.utils.sequences import common_prefix  # noqa: E402


def scan(cache: PrefixCache, ids: list[int]) -> int:
    """The longest common prefix by comparing every entry."""
    return max((common_prefix(e.ids, ids) for e in cache._entries.values()), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", default="100,1000,3000")
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--tail-tokens", type=int, default=80)
    args = ap.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(args.system_tokens)]
    n_tokens = args.system_tokens + args.tail_tokens
    kv = [(torch.zeros(1, n_tokens, 2), torch.zeros(1, n_tokens, 2))]
    print(f"entries sharing a {args.system_tokens}-token system prompt, each {n_tokens} tokens; mean of 20 calls")
    print("| entries | match ms | scan of every entry ms | put ms |")
    print("|---|---|---|---|")
    for n in (int(x) for x in args.entries.split(",")):
        cache = PrefixCache(max_tokens=10**12)
        for _ in range(n):
            cache.put(system + [rng.randrange(50_000) for _ in range(args.tail_tokens)], kv)
        probes = [system + [rng.randrange(50_000) for _ in range(args.tail_tokens)] for _ in range(20)]
        t0 = time.perf_counter()
        found = [cache.match(p)[1] for p in probes]
        t1 = time.perf_counter()
        scanned = [min(scan(cache, p), len(p) - 1) for p in probes]
        t2 = time.perf_counter()
        assert found == scanned
        for p in probes:
            cache.put(p, kv)
        t3 = time.perf_counter()
        print(f"| {n} | {(t1 - t0) / 20 * 1000:.3f} | {(t2 - t1) / 20 * 1000:.3f} | {(t3 - t2) / 20 * 1000:.3f} |")


if __name__ == "__main__":
    main()
