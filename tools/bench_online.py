"""Serving through weight pushes: /v1 latency with and without a push in progress, side by side.

Online training pushes new weights into engines that are serving live users, so what matters is
that no request fails during a push and that latency stays close to normal. This brings up the
real path (CPU engines behind the sgl-router, the gateway as its own process), runs ``--clients``
threads that each send chat completions with the ``openai`` SDK in a loop, and alternates quiet
windows with bursts of bucketed pushes (``WeightPusher``, rolling engine by engine when there are
several; with one engine requests wait through the switch). Weights alternate between the model and
a perturbed copy, so every push really swaps them. Each request is labelled by whether a push was
in progress at any moment of its life; the report compares the two groups measured in the same run.

    python tools/bench_online.py --engines 1 --clients 8 --pushes 12
    python tools/bench_online.py --engines 2 --clients 8 --pushes 12
Goal: zero failed requests; p99 during pushes <= 2x p99 without.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel

from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group, python_module_cmd, spawn

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something short."}]


class Request(BaseModel):
    start: float
    end: float
    ok: bool
    error: str | None = None


class LatencyStats(BaseModel):
    requests: int
    failed: int
    p50_ms: float
    p99_ms: float


class OnlineBenchResult(BaseModel):
    engines: int
    clients: int
    pushes: int
    push_seconds_mean: float
    quiet: LatencyStats
    during_push: LatencyStats
    p99_ratio: float
    failed: int
    errors: list[str]
    engine_versions: dict[str, str | None]
    final_version: str


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def stats(reqs: list[Request]) -> LatencyStats:
    lat = [r.end - r.start for r in reqs if r.ok]
    return LatencyStats(requests=len(reqs), failed=sum(not r.ok for r in reqs),
                        p50_ms=round(percentile(lat, 50) * 1e3, 1), p99_ms=round(percentile(lat, 99) * 1e3, 1))


def weight_variants(model_path: str) -> list[dict[str, object]]:
    """The served weights and a slightly perturbed copy (HF names, as the trainer pushes them)."""
    import torch
    from safetensors.torch import load_file

    base: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        base.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(0)
    other = {k: v + 1e-3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
             for k, v in base.items()}
    return [base, other]


def client_loop(base_url: str, stop: threading.Event, out: list[Request], max_tokens: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=120)
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = client.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=max_tokens,
                                               temperature=1.0)
            ok = bool(r.choices) and r.usage is not None and r.usage.completion_tokens > 0
            out.append(Request(start=t0, end=time.perf_counter(), ok=ok, error=None if ok else "empty answer"))
        except Exception as e:  # every failure counts; the message says which
            out.append(Request(start=t0, end=time.perf_counter(), ok=False, error=f"{type(e).__name__}: {e}"[:300]))


class ServingStack(BaseModel):
    """What ``serving_stack`` brought up: engines behind the sgl-router, the gateway process in front."""

    model_path: str
    engine_urls: list[str]
    engine_pids: list[int]
    base_url: str  # the gateway, without /v1
    gateway_pid: int
    db_path: Path
    logs: Path


@contextmanager
def serving_stack(model: str, engines: int, log_dir: str | Path | None, name: str) -> Iterator[ServingStack]:
    """CPU engines (no restart monitor), the real router, the gateway as its own process; all stopped after."""
    from slime_server.config import RouterSettings
    from slime_server.rollout.actors import EngineActor, EngineSpec
    from slime_server.rollout.router import RouterProcess
    from slime_server.server.launch import resolve_model_path

    model_path = resolve_model_path(model)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    logs.mkdir(parents=True, exist_ok=True)
    actors = [EngineActor(EngineSpec(model_path=model_path, log_path=str(logs / f"engine{i}.log")), start=False,
                          monitor=False) for i in range(engines)]
    gw_proc = None
    try:
        for a in actors:
            a.start()
        urls = [a.url() for a in actors]
        with RouterProcess(RouterSettings(), log_path=logs / "router.log") as router:
            router.start(worker_urls=urls)
            deadline = time.monotonic() + 120
            while len(router.worker_urls(healthy_only=True)) < engines:
                if time.monotonic() > deadline:
                    raise RuntimeError("the router never saw every engine healthy")
                time.sleep(0.2)
            port, db = find_free_port(), logs / "traj.db"
            gw_proc = spawn(python_module_cmd("slime_server.cli", "gateway", "--router-url", router.url, "--model-path",
                                              model_path, "--db-path", str(db), "--port", str(port),
                                              "--served-model-name", name), log_path=str(logs / "gateway.log"))
            base = f"http://127.0.0.1:{port}"
            wait_http_ok(f"{base}/health", timeout=120, proc=gw_proc)
            yield ServingStack(model_path=model_path, engine_urls=urls, engine_pids=[a.pid() for a in actors],
                               base_url=base, gateway_pid=gw_proc.pid, db_path=db, logs=logs)
    finally:
        if gw_proc is not None:
            kill_group(gw_proc)
        for a in actors:
            a.stop()


def run_bench(model: str = "tiny", engines: int = 1, clients: int = 8, pushes: int = 12, burst: int = 3,
              quiet_s: float = 3.0, max_tokens: int = 8, bucket_mib: float = 1.0,
              log_dir: str | Path | None = None) -> OnlineBenchResult:
    from slime_server.trainer.weight_push import WeightPusher

    with serving_stack(model, engines, log_dir, "bench") as stack:
        return _measure(f"{stack.base_url}/v1", stack.engine_urls, weight_variants(stack.model_path), WeightPusher,
                        engines=engines, clients=clients, pushes=pushes, burst=burst, quiet_s=quiet_s,
                        max_tokens=max_tokens, bucket_bytes=int(bucket_mib * 2**20))


def _measure(base_url: str, urls: list[str], variants: list[dict[str, object]], pusher_cls: type, *, engines: int,
             clients: int, pushes: int, burst: int, quiet_s: float, max_tokens: int,
             bucket_bytes: int) -> OnlineBenchResult:
    stop = threading.Event()
    results: list[list[Request]] = [[] for _ in range(clients)]
    threads = [threading.Thread(target=client_loop, args=(base_url, stop, results[i], max_tokens), daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    windows: list[tuple[float, float]] = []
    done = 0
    try:
        time.sleep(quiet_s)  # warm-up: connections open, engines busy
        with pusher_cls(urls, bucket_bytes=bucket_bytes, rolling=True, sender=True) as pusher:
            while done < pushes:
                time.sleep(quiet_s)
                for _ in range(min(burst, pushes - done)):
                    done += 1
                    t0 = time.perf_counter()
                    pusher.push(iter(variants[done % 2].items()), version=f"bench-{done}")
                    windows.append((t0, time.perf_counter()))
            versions = pusher.versions()
        time.sleep(quiet_s)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    warm_end = windows[0][0] - quiet_s if windows else 0.0
    reqs = [r for rs in results for r in rs if r.start >= warm_end]
    during = [r for r in reqs if any(r.start < e and r.end > s for s, e in windows)]
    quiet = [r for r in reqs if not any(r.start < e and r.end > s for s, e in windows)]
    q, d = stats(quiet), stats(during)
    failed = [r for r in reqs if not r.ok]
    return OnlineBenchResult(
        engines=engines, clients=clients, pushes=done,
        push_seconds_mean=round(sum(e - s for s, e in windows) / max(1, len(windows)), 3),
        quiet=q, during_push=d, p99_ratio=round(d.p99_ms / q.p99_ms, 2) if q.p99_ms else float("nan"),
        failed=len(failed), errors=sorted({r.error or "" for r in failed})[:5], engine_versions=versions,
        final_version=f"bench-{done}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="engine counts to measure, in turn")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pushes", type=int, default=12)
    ap.add_argument("--burst", type=int, default=3, help="pushes back to back per push window")
    ap.add_argument("--quiet-s", type=float, default=4.0, help="seconds between push windows")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--bucket-mib", type=float, default=1.0)
    a = ap.parse_args()
    for n in a.engines:
        res = run_bench(a.model, n, a.clients, a.pushes, a.burst, a.quiet_s, a.max_tokens, a.bucket_mib)
        print(json.dumps(res.model_dump(), indent=2))
        print(f"engines={n}: {res.pushes} pushes ({res.push_seconds_mean * 1e3:.0f} ms each), "
              f"{res.quiet.requests + res.during_push.requests} requests, failed {res.failed}; p99 quiet "
              f"{res.quiet.p99_ms:.0f} ms vs during pushes {res.during_push.p99_ms:.0f} ms = {res.p99_ratio:.2f}x "
              f"(goal <= 2x); p50 {res.quiet.p50_ms:.0f} vs {res.during_push.p50_ms:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
