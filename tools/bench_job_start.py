"""Job start: how long a job waits for its trainer, with a finished job's rank processes kept warm or not.

A job's Megatron ranks used to be new processes every time, and their start is mostly imports (torch,
Megatron-core, transformers). ``trainer.warm_ranks_s`` keeps a finished job's ranks idle for the next job of the
same shape. This starts ``slime-server serve`` (tiny model, one engine) once with the default and once with
``SLIME_TRAINER__WARM_RANKS_S=0``, alternating for ``--rounds`` rounds, and in each runs ``--jobs`` one-step SFT jobs
one after another; per job it reads the ``trainer_ready`` event's seconds (the ranks started or taken, set up, the
weights loaded) and whether the ranks were warm, and times submit -> completed. The first job of a server is cold
either way; the table compares the later ones.

    python tools/bench_job_start.py --rounds 2 --jobs 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slime_server.utils.net import find_free_port, wait_http_ok

CONVERSATIONS = [("What is 2 + 2?", "4"), ("Say hi.", "Hi!"), ("Name a colour.", "Blue."), ("Count to 3.", "1 2 3")]


def events(c: httpx.Client, job_id: str) -> list[dict]:
    with c.stream("GET", f"/jobs/{job_id}/events", params={"follow": "false"}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def one_server(warm: bool, jobs: int, work: Path) -> list[dict]:
    """Start serve, run ``jobs`` SFT jobs in a row; per job: trainer_ready seconds, warm, submit -> completed."""
    port = find_free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "SLIME_TRAINER__WORK_DIR": str(work / "jobs")}
    if not warm:
        env["SLIME_TRAINER__WARM_RANKS_S"] = "0"
    data = work / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                                      "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS))
    proc = subprocess.Popen([sys.executable, "-m", "slime_server.cli", "serve", "--model", "tiny", "--port", str(port),
                             "--db-path", str(work / "db.sqlite")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    out = []
    try:
        wait_http_ok(f"{url}/health", timeout=300, proc=proc)
        with httpx.Client(base_url=url, timeout=300) as c:
            for _ in range(jobs):
                t0 = time.monotonic()
                j = c.post("/jobs", json={"algorithm": "sft", "data": {"source": "conversations",
                                                                       "dataset": str(data), "epochs": 1},
                                          "loop": {"batch_size": 4, "checkpoint_interval": 100,
                                                   "poll_interval_s": 0.05}}).raise_for_status().json()
                while (s := c.get(f"/jobs/{j['id']}").raise_for_status().json())["status"] not in (
                        "completed", "failed", "cancelled"):
                    time.sleep(0.1)
                if s["status"] != "completed":
                    raise SystemExit(f"job {j['id']} {s['status']}: {s.get('error')}")
                ready = next(e["data"] for e in events(c, j["id"]) if e["kind"] == "trainer_ready")
                out.append({"trainer_ready_s": ready["seconds"], "warm": ready.get("warm", False),
                            "job_s": round(time.monotonic() - t0, 3)})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=4, help="jobs per server, one after another (>= 2)")
    args = ap.parse_args()
    if args.jobs < 2:
        ap.error("--jobs must be at least 2: a server's first job is cold either way")
    later: dict[str, dict[str, list[float]]] = {m: {"trainer_ready_s": [], "job_s": []} for m in ("warm", "cold")}
    for r in range(args.rounds):
        for mode in ("cold", "warm") if r % 2 else ("warm", "cold"):
            with tempfile.TemporaryDirectory() as tmp:
                runs = one_server(mode == "warm", args.jobs, Path(tmp))
            print(json.dumps({"round": r, "mode": mode, "jobs": runs}), flush=True)
            for run in runs[1:]:
                if run["warm"] != (mode == "warm"):
                    raise SystemExit(f"a {mode} server's later job started with warm={run['warm']}")
                for k in ("trainer_ready_s", "job_s"):
                    later[mode][k].append(run[k])
    print(f"{'later jobs':<10} {'trainer_ready s (median, min-max)':<36} {'submit -> completed s':<28}")
    for mode, m in later.items():
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in m.values()]
        print(f"{mode:<10} {cells[0]:<36} {cells[1]:<28}")


if __name__ == "__main__":
    main()
