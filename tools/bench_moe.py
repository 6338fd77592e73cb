"""MoE benchmarks (issue 44), each side by side in one run:

    python tools/bench_moe.py store                 # bytes recorded per token: ours vs SGLang's answer
    python tools/bench_moe.py session [--turns 40]  # a long session's per-turn latency, routes recorded vs not
    python tools/bench_moe.py decode [--rounds 3]   # the tiny MoE's decode: the CPU engine vs HF generate

``store``: the routes of one token as the trajectory store keeps them (``buffer/routed_experts.py``: one byte per
id up to 256 experts, two above) against SGLang's answer (int32, and its base64 on the wire), for the tiny MoE and
the real Qwen3-30B-A3B / Qwen3-235B-A22B / DeepSeek-V3 shapes, from real ``RoutedExperts`` objects.

``session``: one CPU engine serving the tiny MoE with ``--enable-return-routed-experts``, two gateways in this
process in front of it, one recording routes and one not; one session each grows turn by turn (a user message,
8 generated tokens, greedy), the two alternating turn for turn so drift hits both alike. Prints the median latency
of the last five turns of each and their ratio, and the session's stored bytes of routes and of tokens.

``decode``: the tiny MoE (8 experts, top-2) in the CPU engine (lean forward) against HF's ``generate`` on the same
weights, batch 1 and 8 concurrent, greedy, EOS ignored, rounds alternating.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.models.tiny import ensure_tiny_model, tiny_moe_spec

SHAPES = {"tiny MoE": (4, 2, 8), "Qwen3-30B-A3B": (48, 8, 128), "Qwen3-235B-A22B": (94, 8, 128),
          "DeepSeek-V3": (61, 8, 256)}  # layers, top-k, experts


def store() -> None:
    print("| model | layers x top-k | ours (B/token) | SGLang int32 | SGLang base64 |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, (layers, topk, experts) in SHAPES.items():
        ids = rng.integers(0, experts, size=(1000, layers, topk))
        ours = len(RoutedExperts.of(ids).pack()) / 1000
        raw = ids.astype("<i4").tobytes()
        print(f"| {name} | {layers} x {topk} | {ours:.0f} | {len(raw) / 1000:.0f} | "
              f"{len(base64.b64encode(raw)) / 1000:.0f} |")


def session(turns: int) -> None:
    import httpx

    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.config import GatewaySettings
    from slime_server.server.build import build_gateway
    from slime_server.server.gateway_thread import GatewayThread
    from slime_server.utils.net import find_free_port, wait_http_ok

    path = ensure_tiny_model(spec=tiny_moe_spec())
    work = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    port = find_free_port()
    engine = subprocess.Popen([sys.executable, "-m", "slime_server.rollout.engine_server", "--model-path", str(path),
                               "--port", str(port), "--num-threads", "1", "--enable-return-routed-experts"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers, urls = [], {}
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=120, proc=engine)
        for kind, record in (("routes", True), ("no routes", False)):
            gport = find_free_port()
            settings = GatewaySettings(port=gport, db_path=str(work / f"{kind}.db"), served_model_name="tiny",
                                       record_routed_experts=record)
            servers.append(GatewayThread(build_gateway(f"http://127.0.0.1:{port}", path, settings), "127.0.0.1",
                                         gport).start())
            urls[kind] = f"http://127.0.0.1:{gport}/v1"
        times: dict[str, list[float]] = {k: [] for k in urls}
        messages: dict[str, list[dict]] = {k: [] for k in urls}
        with httpx.Client(timeout=120) as c:
            for turn in range(turns):
                for kind, url in urls.items():
                    messages[kind].append({"role": "user", "content": f"Turn {turn}: what is {turn} + {turn}?"})
                    t0 = time.perf_counter()
                    r = c.post(f"{url}/chat/completions", headers={"X-Session-Id": f"bench-{kind}"}, json={
                        "model": "tiny", "messages": messages[kind], "max_tokens": 8, "temperature": 0})
                    times[kind].append(time.perf_counter() - t0)
                    r.raise_for_status()
                    messages[kind].append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        last = {k: statistics.median(v[-5:]) * 1000 for k, v in times.items()}
        store_ = SQLiteTrajectoryStore(str(work / "routes.db"))
        (traj,) = store_.get_trajectories("bench-routes")
        store_.close()
        print(f"{turns} turns, {len(traj.tokens)} tokens at the end; median of the last 5 turns: routes recorded "
              f"{last['routes']:.1f} ms, not recorded {last['no routes']:.1f} ms "
              f"(x{last['routes'] / last['no routes']:.2f}); stored: routes {len(traj.routed_experts.pack())} B, "
              f"tokens {4 * len(traj.tokens)} B")
    finally:
        for s in servers:
            s.stop()
        engine.terminate()
        engine.wait()


def decode(rounds: int, new: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from slime_server.rollout.cpu_engine import CPUEngine
    from slime_server.rollout.engine_config import EngineConfig
    from slime_server.rollout.protocol import SamplingParams

    torch.set_num_threads(2)
    path = ensure_tiny_model(spec=tiny_moe_spec())
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = CPUEngine(EngineConfig(model_path=str(path), num_threads=2))
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(8)]
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    results: dict[str, list[float]] = {"engine 1": [], "HF 1": [], "engine 8": [], "HF 8": []}
    try:
        for _ in range(rounds):
            for batch in (1, 8):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(batch) as pool:
                    list(pool.map(lambda p: engine.generate(p, params), prompts[:batch]))
                results[f"engine {batch}"].append(batch * new / (time.perf_counter() - t0))
                ids = torch.tensor(prompts[:batch])
                t0 = time.perf_counter()
                with torch.no_grad():
                    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=0)
                results[f"HF {batch}"].append(batch * new / (time.perf_counter() - t0))
    finally:
        engine.shutdown()
    for batch in (1, 8):
        e, h = statistics.median(results[f"engine {batch}"]), statistics.median(results[f"HF {batch}"])
        print(f"batch {batch}: engine {e:.0f} tok/s ({min(results[f'engine {batch}']):.0f}-"
              f"{max(results[f'engine {batch}']):.0f}), HF generate {h:.0f} tok/s; x{e / h:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("store")
    s = sub.add_parser("session")
    s.add_argument("--turns", type=int, default=40)
    d = sub.add_parser("decode")
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    if args.what == "store":
        store()
    elif args.what == "session":
        session(args.turns)
    else:
        decode(args.rounds, args.new)


if __name__ == "__main__":
    main()
