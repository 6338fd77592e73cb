"""What the gateway costs: router ``/generate`` directly vs ``/v1/chat/completions`` (recording on).

Same engine, same router, same prompt ids, same number of generated tokens (greedy, ignore_eos):
the difference is the gateway (parsing, templating, SQLite commit with fsync, OpenAI shaping).
Latency is measured with one request in flight, alternating the two paths so that machine noise
hits both alike; throughput with ``--concurrency`` requests in flight per path.

    python tools/bench_gateway.py --requests 60 --max-tokens 4 --concurrency 8
Target: gateway adds <= 10% at p50 and <= 25% at p99.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group, python_module_cmd, spawn

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something short."}]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=60, help="latency samples per path")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--throughput-requests", type=int, default=48)
    a = ap.parse_args()

    from slime_server.config import RouterSettings
    from slime_server.gateway.chat_template import ChatRenderer
    from slime_server.rollout.actors import EngineActor, EngineSpec
    from slime_server.rollout.router import RouterProcess
    from slime_server.server.launch import resolve_model_path

    model = resolve_model_path(a.model)
    prompt_ids = ChatRenderer(model).render_ids(MESSAGES)
    tmp = Path(tempfile.mkdtemp(prefix="bench_gateway_"))
    engine = EngineActor(EngineSpec(model_path=model, log_path=str(tmp / "engine.log")), start=False, monitor=False)
    engine.start()
    gw_proc = None
    try:
        with RouterProcess(RouterSettings(), log_path=tmp / "router.log") as router:
            router.start(worker_urls=[engine.url()])
            while not router.worker_urls(healthy_only=True):
                time.sleep(0.2)
            port = find_free_port()
            gw_proc = spawn(python_module_cmd("slime_server.cli", "gateway", "--router-url", router.url, "--model-path",
                                              model, "--db-path", str(tmp / "traj.db"), "--port", str(port),
                                              "--served-model-name", "bench"), log_path=str(tmp / "gateway.log"))
            gw_url = f"http://127.0.0.1:{port}"
            wait_http_ok(f"{gw_url}/health", timeout=120, proc=gw_proc)
            result = run(router.url, gw_url, prompt_ids, a)
    finally:
        if gw_proc is not None:
            kill_group(gw_proc)
        engine.stop()
    print(json.dumps(result, indent=2))


def run(router_url: str, gw_url: str, prompt_ids: list[int], a: argparse.Namespace) -> dict:
    direct_body = {"input_ids": prompt_ids, "return_logprob": True,
                   "sampling_params": {"temperature": 0, "max_new_tokens": a.max_tokens, "ignore_eos": True}}
    chat_body = {"model": "bench", "messages": MESSAGES, "temperature": 0, "max_tokens": a.max_tokens,
                 "ignore_eos": True}
    client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    def direct() -> float:
        t = time.perf_counter()
        r = client.post(f"{router_url}/generate", json=direct_body)
        r.raise_for_status()
        assert len(r.json()["output_ids"]) == a.max_tokens
        return time.perf_counter() - t

    def chat() -> float:
        t = time.perf_counter()
        r = client.post(f"{gw_url}/v1/chat/completions", json=chat_body)
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == a.max_tokens
        return time.perf_counter() - t

    for _ in range(a.warmup):
        direct()
        chat()
    lat_d, lat_g = [], []
    for i in range(a.requests):  # alternate (and swap order) so drift affects both paths alike
        first, second = (direct, chat) if i % 2 == 0 else (chat, direct)
        x, y = first(), second()
        (lat_d, lat_g)[first is chat].append(x)
        (lat_d, lat_g)[second is chat].append(y)

    def throughput(fn) -> float:
        t = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(lambda _: fn(), range(a.throughput_requests)))
        return a.throughput_requests / (time.perf_counter() - t)

    rps_d, rps_g = throughput(direct), throughput(chat)
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    d50, d99, g50, g99 = pct(lat_d, 50), pct(lat_d, 99), pct(lat_g, 50), pct(lat_g, 99)
    return {
        "max_tokens": a.max_tokens, "requests_per_path": a.requests, "concurrency": a.concurrency,
        "direct_ms": {"p50": ms(d50), "p99": ms(d99), "mean": ms(statistics.mean(lat_d))},
        "gateway_ms": {"p50": ms(g50), "p99": ms(g99), "mean": ms(statistics.mean(lat_g))},
        "overhead_p50": round(g50 / d50 - 1, 3), "overhead_p99": round(g99 / d99 - 1, 3),
        "overhead_p50_ms": ms(g50 - d50),
        "direct_rps": round(rps_d, 2), "gateway_rps": round(rps_g, 2), "rps_ratio": round(rps_g / rps_d, 3),
        "targets_met": {"p50<=10%": g50 / d50 - 1 <= 0.10, "p99<=25%": g99 / d99 - 1 <= 0.25},
    }


if __name__ == "__main__":
    main()
