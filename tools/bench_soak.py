"""Soak: N agents for a set time while weights are pushed; errors, throughput, p99 and memory growth.

A long-running RL server must not leak, slow down or drop data as hours of episodes go by. This
brings up the real path (CPU engines behind the sgl-router, the gateway as its own process) and runs
``--agents`` threads, each playing episodes in a loop with the ``openai`` SDK: open a session, two
chat turns (the second extends the first: session merge), post a reward, close. A pusher thread
swaps the engines' weights every ``--push-every-s`` (rolling, bucketed). Every few seconds the
resident memory of the gateway and of each engine is sampled; growth is reported as the change
between the first and the last third of the run (so warm-up allocations do not count) and as a
least-squares slope. At the end the store must hold every acknowledged reward.

    python tools/bench_soak.py --agents 8 --duration-s 600 --engines 2
Goals: 0 errors; p99 flat; memory flat (growth within noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark: the stack and weight variants
from bench_online import serving_stack, weight_variants  # noqa: E402

SYSTEM = {"role": "system", "content": "You are terse."}


class Episode(BaseModel):
    start: float
    end: float
    turn_ms: list[float]
    ok: bool
    error: str | None = None
    session_id: str | None = None


class MemorySeries(BaseModel):
    name: str
    first_mb: float  # mean RSS over the first third of the run
    last_mb: float  # ... and over the last third
    growth_mb: float
    slope_mb_per_min: float


class SoakWindow(BaseModel):
    """One stretch of the run (``--window-s``): episodes started in it, their turns, the RSS of each process."""

    start_s: float
    end_s: float
    episodes: int
    errors: int
    turn_p50_ms: float
    turn_p99_ms: float
    rss_mb: dict[str, float]  # mean over the window's samples


class SoakResult(BaseModel):
    agents: int
    engines: int
    duration_s: float
    episodes: int
    turns: int
    errors: int
    error_samples: list[str]
    episodes_per_s: float
    turn_p50_ms: float
    turn_p99_ms: float
    turn_p99_first_half_ms: float
    turn_p99_second_half_ms: float
    pushes: int  # pushes that completed (every engine on the new version)
    push_errors: list[str]  # pushes that failed, in order (the soak goes on pushing)
    memory: list[MemorySeries]
    windows: list[SoakWindow] = []
    # per process: RSS slope after the first window (warm-up), MB per 10 min (goal < 5)
    growth_after_warmup_mb_per_10min: dict[str, float] = {}
    rewards_acknowledged: int
    rewards_in_store: int


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def series(name: str, samples: list[tuple[float, float]]) -> MemorySeries:
    ts, ys = [t for t, _ in samples], [y for _, y in samples]
    third = max(1, len(ys) // 3)
    first, last = statistics.fmean(ys[:third]), statistics.fmean(ys[-third:])
    slope = statistics.linear_regression(ts, ys).slope * 60 if len(ys) > 1 and len(set(ts)) > 1 else 0.0
    return MemorySeries(name=name, first_mb=round(first, 1), last_mb=round(last, 1), growth_mb=round(last - first, 1),
                        slope_mb_per_min=round(slope, 2))


def windows(episodes: list[Episode], t_start: float, elapsed: float, window_s: float,
            mem: dict[str, list[tuple[float, float]]]) -> list[SoakWindow]:
    out = []
    n = max(1, int(elapsed // window_s + (elapsed % window_s > window_s / 2)))
    for w in range(n):
        lo, hi = w * window_s, (w + 1) * window_s if w < n - 1 else elapsed
        eps = [e for e in episodes if lo <= e.start - t_start < hi]
        turns = [ms for e in eps if e.ok for ms in e.turn_ms]
        rss = {name: round(statistics.fmean(ys), 1) if (ys := [y for t, y in s if lo <= t < hi]) else float("nan")
               for name, s in mem.items()}
        out.append(SoakWindow(start_s=round(lo), end_s=round(hi), episodes=len(eps),
                              errors=sum(not e.ok for e in eps), turn_p50_ms=round(percentile(turns, 50), 1),
                              turn_p99_ms=round(percentile(turns, 99), 1), rss_mb=rss))
    return out


def growth_after_warmup(mem: dict[str, list[tuple[float, float]]], warmup_s: float) -> dict[str, float]:
    out = {}
    for name, s in mem.items():
        pts = [(t, y) for t, y in s if t >= warmup_s]
        if len(pts) > 2 and len({t for t, _ in pts}) > 1:
            out[name] = round(statistics.linear_regression([t for t, _ in pts], [y for _, y in pts]).slope * 600, 2)
    return out


def agent_loop(base_url: str, stop: threading.Event, out: list[Episode], max_tokens: int) -> None:
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=120)
    http = httpx.Client(base_url=base_url, timeout=120)
    i = 0
    while not stop.is_set():
        i += 1
        t0, turns, sid = time.perf_counter(), [], None
        try:
            sid = http.post("/sessions", json={}).raise_for_status().json()["id"]
            messages = [SYSTEM, {"role": "user", "content": f"Episode {i}: say something short."}]
            for follow_up in ("And one more thing?", None):
                t = time.perf_counter()
                r = client.chat.completions.create(model="soak", messages=messages, max_tokens=max_tokens,
                                                   temperature=1.0, extra_headers={"X-Session-Id": sid})
                turns.append((time.perf_counter() - t) * 1e3)
                messages += [{"role": "assistant", "content": r.choices[0].message.content or ""}]
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
            http.post(f"/sessions/{sid}/reward", json={"reward": float(i % 2)}).raise_for_status()
            http.post(f"/sessions/{sid}/close", json={}).raise_for_status()
            out.append(Episode(start=t0, end=time.perf_counter(), turn_ms=turns, ok=True, session_id=sid))
        except Exception as e:  # every failure counts; the message says which
            out.append(Episode(start=t0, end=time.perf_counter(), turn_ms=turns, ok=False, session_id=sid,
                               error=f"{type(e).__name__}: {e}"[:300]))
    http.close()


def run_soak(model: str = "tiny", engines: int = 2, agents: int = 8, duration_s: float = 60.0,
             push_every_s: float = 5.0, max_tokens: int = 8, sample_every_s: float = 2.0,
             log_dir: str | Path | None = None, window_s: float = 300.0) -> SoakResult:
    from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
    from slime_server.trainer.weight_push import WeightPusher

    with serving_stack(model, engines, log_dir, "soak") as stack:
        variants = weight_variants(stack.model_path)
        pids = {"gateway": stack.gateway_pid, **{f"engine{i}": pid for i, pid in enumerate(stack.engine_pids)}}
        stop = threading.Event()
        results: list[list[Episode]] = [[] for _ in range(agents)]
        threads = [threading.Thread(target=agent_loop, args=(f"{stack.base_url}/v1", stop, results[i], max_tokens),
                                    daemon=True) for i in range(agents)]
        pushes = 0
        push_errors: list[str] = []

        def pusher_loop() -> None:
            nonlocal pushes
            with WeightPusher(stack.engine_urls, rolling=True, sender=True) as pusher:
                attempt = 0
                while not stop.wait(push_every_s):
                    attempt += 1
                    try:  # counted once it completed; a failure is recorded, never swallowed
                        pusher.push(iter(variants[attempt % 2].items()), version=f"soak-{attempt}")
                    except Exception as e:  # noqa: BLE001 - any push failure is a soak finding
                        push_errors.append(f"push {attempt}: {type(e).__name__}: {e}"[:300])
                    else:
                        pushes += 1

        mem: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        t_start = time.perf_counter()
        for t in threads:
            t.start()
        push_thread = threading.Thread(target=pusher_loop, daemon=True)
        push_thread.start()
        while time.perf_counter() - t_start < duration_s:
            time.sleep(sample_every_s)
            now = time.perf_counter() - t_start
            for name, pid in pids.items():
                mem[name].append((now, rss_mb(pid)))
        stop.set()
        push_thread.join(timeout=120)
        for t in threads:
            t.join(timeout=150)
        elapsed = time.perf_counter() - t_start

    episodes = [e for rs in results for e in rs]
    ok = [e for e in episodes if e.ok]
    turn_ms = [ms for e in ok for ms in e.turn_ms]
    half = t_start + elapsed / 2
    first = [ms for e in ok if e.start < half for ms in e.turn_ms]
    second = [ms for e in ok if e.start >= half for ms in e.turn_ms]
    store = SQLiteTrajectoryStore(stack.db_path)
    acknowledged = {e.session_id for e in ok}
    in_store = sum(1 for sid in acknowledged
                   if any(t.reward is not None for t in store.get_trajectories(sid)))
    store.close()
    errors = [e for e in episodes if not e.ok]
    return SoakResult(
        agents=agents, engines=engines, duration_s=round(elapsed, 1), episodes=len(episodes),
        turns=len(turn_ms), errors=len(errors), error_samples=sorted({e.error or "" for e in errors})[:5],
        episodes_per_s=round(len(ok) / elapsed, 2), turn_p50_ms=round(percentile(turn_ms, 50), 1),
        turn_p99_ms=round(percentile(turn_ms, 99), 1), turn_p99_first_half_ms=round(percentile(first, 99), 1),
        turn_p99_second_half_ms=round(percentile(second, 99), 1), pushes=pushes, push_errors=push_errors,
        memory=[series(name, s) for name, s in mem.items()],
        windows=windows(episodes, t_start, elapsed, window_s, mem),
        growth_after_warmup_mb_per_10min=growth_after_warmup(mem, min(window_s, elapsed / 3)),
        rewards_acknowledged=len(acknowledged),
        rewards_in_store=in_store)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--push-every-s", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=300.0, help="report errors, latency and memory per window")
    a = ap.parse_args()
    res = run_soak(a.model, a.engines, a.agents, a.duration_s, a.push_every_s, a.max_tokens, window_s=a.window_s)
    print(json.dumps(res.model_dump(), indent=2))
    names = list(res.windows[0].rss_mb) if res.windows else []
    print("| window (min) | episodes | errors | turn p50 ms | turn p99 ms | " + " | ".join(f"{n} MB" for n in names) + " |")
    print("|---" * (5 + len(names)) + "|")
    for w in res.windows:
        print(f"| {w.start_s / 60:.0f}-{w.end_s / 60:.0f} | {w.episodes} | {w.errors} | {w.turn_p50_ms} | {w.turn_p99_ms} | "
              + " | ".join(f"{w.rss_mb[n]:.0f}" for n in names) + " |")
    print("RSS slope after the first window, MB per 10 min: "
          + ", ".join(f"{n} {v:+.2f}" for n, v in res.growth_after_warmup_mb_per_10min.items()))
    mem = ", ".join(f"{m.name} {m.first_mb:.0f}->{m.last_mb:.0f} MB ({m.slope_mb_per_min:+.2f} MB/min)"
                    for m in res.memory)
    print(f"{res.agents} agents x {res.duration_s:.0f} s, {res.pushes} pushes: {res.episodes} episodes "
          f"({res.episodes_per_s}/s), {res.errors} errors (goal 0); turn p50 {res.turn_p50_ms} ms, p99 "
          f"{res.turn_p99_ms} ms (first half {res.turn_p99_first_half_ms} vs second {res.turn_p99_second_half_ms}); "
          f"rewards in store {res.rewards_in_store}/{res.rewards_acknowledged}; memory: {mem}", flush=True)


if __name__ == "__main__":
    main()
