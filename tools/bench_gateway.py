"""What the gateway costs: router ``/generate`` directly vs ``/v1/chat/completions`` (recording on).

Same engine, same router, same prompt ids, same number of generated tokens (greedy, ignore_eos):
the difference is the gateway (parsing, templating, SQLite commit with fsync, OpenAI shaping).
Latency is measured with one request in flight, alternating the paths so that machine noise
hits them alike; throughput with ``--concurrency`` requests in flight per path.

A third path measures the floor under any gateway written in Python: ``hop``, a process that does
nothing but forward the same ``/generate`` body to the router and its answer back (aiohttp server and
client, both with C HTTP parsers). What the gateway adds beyond the hop is its own work.

    python tools/bench_gateway.py --requests 60 --max-tokens 4 --concurrency 8
Target: gateway adds <= 10% at p50 and <= 25% at p99.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
    ap.add_argument("--serve-hop", nargs=2, metavar=("PORT", "ROUTER_URL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_hop:
        return serve_hop(int(a.serve_hop[0]), a.serve_hop[1])

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
    gw_proc = hop_proc = None
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
            hop_port = find_free_port()
            hop_proc = spawn([sys.executable, __file__, "--serve-hop", str(hop_port), router.url],
                             log_path=str(tmp / "hop.log"))
            hop_url = f"http://127.0.0.1:{hop_port}"
            wait_http_ok(f"{hop_url}/health", timeout=60, proc=hop_proc)
            result = run(router.url, gw_url, hop_url, prompt_ids, a)
    finally:
        for proc in (gw_proc, hop_proc):
            if proc is not None:
                kill_group(proc)
        engine.stop()
    print(json.dumps(result, indent=2))


def serve_hop(port: int, router_url: str) -> None:
    """The floor: forward ``/generate`` to the router and its answer back, doing nothing else."""
    import aiohttp
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app["session"].post(f"{router_url}/generate", data=body,
                                               headers={"Content-Type": "application/json"}) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session(app: web.Application):
        app["session"] = aiohttp.ClientSession()
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run(router_url: str, gw_url: str, hop_url: str, prompt_ids: list[int], a: argparse.Namespace) -> dict:
    direct_body = {"input_ids": prompt_ids, "return_logprob": True,
                   "sampling_params": {"temperature": 0, "max_new_tokens": a.max_tokens, "ignore_eos": True}}
    chat_body = {"model": "bench", "messages": MESSAGES, "temperature": 0, "max_tokens": a.max_tokens,
                 "ignore_eos": True}
    client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    def generate(url: str) -> float:
        t = time.perf_counter()
        r = client.post(f"{url}/generate", json=direct_body)
        r.raise_for_status()
        assert len(r.json()["output_ids"]) == a.max_tokens
        return time.perf_counter() - t

    def direct() -> float:
        return generate(router_url)

    def hop() -> float:
        return generate(hop_url)

    def chat() -> float:
        t = time.perf_counter()
        r = client.post(f"{gw_url}/v1/chat/completions", json=chat_body)
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == a.max_tokens
        return time.perf_counter() - t

    paths = (direct, hop, chat)
    for _ in range(a.warmup):
        for fn in paths:
            fn()
    lat: dict = {fn: [] for fn in paths}
    for i in range(a.requests):  # rotate the order so drift affects every path alike
        for k in range(len(paths)):
            fn = paths[(i + k) % len(paths)]
            lat[fn].append(fn())
    lat_d, lat_h, lat_g = lat[direct], lat[hop], lat[chat]

    def throughput(fn) -> float:
        t = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(lambda _: fn(), range(a.throughput_requests)))
        return a.throughput_requests / (time.perf_counter() - t)

    rps_d, rps_g = throughput(direct), throughput(chat)
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    d50, d99, g50, g99 = pct(lat_d, 50), pct(lat_d, 99), pct(lat_g, 50), pct(lat_g, 99)
    h50, h99 = pct(lat_h, 50), pct(lat_h, 99)
    return {
        "max_tokens": a.max_tokens, "requests_per_path": a.requests, "concurrency": a.concurrency,
        "direct_ms": {"p50": ms(d50), "p99": ms(d99), "mean": ms(statistics.mean(lat_d))},
        "hop_ms": {"p50": ms(h50), "p99": ms(h99), "mean": ms(statistics.mean(lat_h))},
        "gateway_ms": {"p50": ms(g50), "p99": ms(g99), "mean": ms(statistics.mean(lat_g))},
        "overhead_p50": round(g50 / d50 - 1, 3), "overhead_p99": round(g99 / d99 - 1, 3),
        "overhead_p50_ms": ms(g50 - d50),
        "hop_overhead_p50": round(h50 / d50 - 1, 3), "hop_overhead_p50_ms": ms(h50 - d50),
        "gateway_beyond_hop_p50_ms": ms(g50 - h50),
        "direct_rps": round(rps_d, 2), "gateway_rps": round(rps_g, 2), "rps_ratio": round(rps_g / rps_d, 3),
        "targets_met": {"p50<=10%": g50 / d50 - 1 <= 0.10, "p99<=25%": g99 / d99 - 1 <= 0.25},
    }


if __name__ == "__main__":
    main()
