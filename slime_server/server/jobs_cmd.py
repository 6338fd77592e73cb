"""``slime-server train CONFIG.yaml`` and ``slime-server jobs list|show|pause|resume|cancel|events|metrics``.

Both talk to a running server's job REST API (``--url``, default the local gateway's port; the admin
key from ``--admin-key`` or the settings' ``gateway.admin_api_key``). ``train`` submits the job spec in
the YAML file (the ``POST /jobs`` body), follows it with one line per step (step, reward, policy
version, tokens/s, evals), prints a summary (where its checkpoints and TensorBoard files are) and exits
with the job's outcome: 0 completed, 1 failed or cancelled, 2 a spec the server (or the local
validation) refused, with its message. ``train --local`` needs no server: it starts what ``serve`` would
(engines, sgl-router, gateway, trainer; the settings tree chooses the model and engines) for this one
job on a free port, and stops it when the job ends (Ctrl-C cancels the job first).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from slime_server.jobs.spec import JobSpec
from slime_server.server.serve_cmd import start_server

FINAL = ("completed", "failed", "cancelled")


def _client(args: argparse.Namespace, settings: Any) -> httpx.Client:
    return _rest(args.url or f"http://127.0.0.1:{settings.gateway.port}",
                 args.admin_key or settings.gateway.admin_api_key)


def _rest(url: str, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=url.rstrip("/"), timeout=60,
                        headers={"Authorization": f"Bearer {key}"} if key else {})


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="the server (default: http://127.0.0.1:<gateway.port>)")
    parser.add_argument("--admin-key", default=None, help="default: gateway.admin_api_key (SLIME_GATEWAY__ADMIN_API_KEY)")


def _error(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:500]


class TrainCommand:
    help = "submit a job spec (YAML) to a running server, follow it, exit with its outcome"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("job_config", type=Path, help="YAML file: the POST /jobs body (JobSpec)")
        parser.add_argument("--max-steps", type=int, default=None, help="override loop.max_steps")
        parser.add_argument("--no-follow", action="store_true", help="print the job id and return")
        parser.add_argument("--poll-s", type=float, default=1.0)
        parser.add_argument("--local", action="store_true",
                            help="start engines, router, gateway and trainer here for this job (as serve would, "
                                 "on a free port) and stop them when it ends")
        parser.add_argument("--log-dir", default=None, help="with --local: engine and router logs (default: temp)")
        _common(parser)

    def run(self, args: argparse.Namespace, settings: Any) -> int:
        import yaml
        from pydantic import ValidationError

        try:
            body = yaml.safe_load(args.job_config.read_text()) or {}
            if args.max_steps is not None:
                body.setdefault("loop", {})["max_steps"] = args.max_steps
            _absolute_paths(body)
            JobSpec.model_validate(body)  # the server validates too; this fails before any network call
        except (OSError, yaml.YAMLError) as e:
            print(f"error: cannot read {args.job_config}: {e}", file=sys.stderr)
            return 2
        except ValidationError as e:
            print(f"error: {args.job_config} is not a valid job spec:\n{e}", file=sys.stderr)
            return 2
        if args.local:
            if args.url:
                print("error: --local starts its own server; drop --url", file=sys.stderr)
                return 2
            return self._run_local(args, settings, body)
        with _client(args, settings) as c:
            return submit_and_follow(c, body, args)

    def _run_local(self, args: argparse.Namespace, settings: Any, body: dict[str, Any]) -> int:
        gw = settings.gateway.model_copy(update={"host": "127.0.0.1", "port": 0})  # any free port, bound at once
        print(f"[train] starting a local server for this job ({settings.engine.num_engines} engine(s), "
              f"model {settings.engine.model})", flush=True)
        running = start_server(settings, gw, args.log_dir)
        previous = signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM cancels the job and stops all, as Ctrl-C
        try:
            with _rest(running.base_url.removesuffix("/v1"), gw.admin_api_key or gw.api_key) as c:
                return submit_and_follow(c, body, args, cancel_on_interrupt=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
            running.stop()


def _absolute_paths(body: dict[str, Any]) -> None:
    """Data files named relative to where ``train`` runs, made absolute: the server (``--local``, or one on this
    machine) resolves paths from its own working directory."""
    sections = [body.get("data")] + list(body.get("eval") or [])
    for section in sections:
        if isinstance(section, dict) and isinstance(section.get("dataset"), str) and Path(section["dataset"]).exists():
            section["dataset"] = str(Path(section["dataset"]).resolve())


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def submit_and_follow(c: httpx.Client, body: dict[str, Any], args: argparse.Namespace, *,
                      cancel_on_interrupt: bool = False) -> int:
    """POST the job, follow it unless ``--no-follow``; the command's exit code."""
    try:
        r = c.post("/jobs", json=body)
    except httpx.ConnectError:
        print(f"error: no server at {c.base_url} (start one with `slime-server serve`, pass --url, or run the "
              "job with --local)", file=sys.stderr)
        return 2
    if r.status_code != 200:
        print(f"error: the server refused the job ({r.status_code}): {_error(r)}", file=sys.stderr)
        return 2
    job = r.json()
    print(f"job {job['id']} {job['status']}", flush=True)
    if args.no_follow:
        return 0
    try:
        job = follow(c, job["id"], args.poll_s)
    except KeyboardInterrupt:
        if cancel_on_interrupt:
            c.post(f"/jobs/{job['id']}/cancel")
            print(f"\ncancelled job {job['id']}", file=sys.stderr)
        else:
            print(f"\nstopped following; the job goes on (slime-server jobs cancel {job['id']})", file=sys.stderr)
        return 130
    return 0 if job["status"] == "completed" else 1


def follow(c: httpx.Client, job_id: str, poll_s: float = 1.0) -> dict[str, Any]:
    """Print a line per new step and eval until the job ends; print the summary; return the final job."""
    seen_steps = seen_evals = 0
    waiting: str | None = None
    while True:
        job = c.get(f"/jobs/{job_id}").raise_for_status().json()
        if job.get("waiting") and job["waiting"] != waiting:  # why no step comes (incomplete groups, ...)
            print(job["waiting"], flush=True)
        waiting = job.get("waiting")
        metrics = c.get(f"/jobs/{job_id}/metrics").raise_for_status().json()
        for row in metrics[seen_steps:]:
            m = row["metrics"]
            print(f"step {row['step']:>4}  reward {m.get('reward_mean', 0.0):7.3f}  version "
                  f"{int(m.get('policy_version', 0)):>4}  loss {m.get('loss', 0.0):8.4f}  "
                  f"{m.get('tokens_per_s', 0.0):8.0f} tok/s", flush=True)
        seen_steps = len(metrics)
        evals = c.get(f"/jobs/{job_id}/evals").raise_for_status().json()["data"]
        for e in evals[seen_evals:]:
            rate = e.get("success_rate")
            print(f"eval {e.get('name')} at step {e.get('step')} (version {e.get('version')}): success {rate}", flush=True)
        seen_evals = len(evals)
        if job["status"] in FINAL:
            break
        time.sleep(poll_s)
    ckpt = job["checkpoints"][-1]["path"] if job["checkpoints"] else None
    print(f"job {job_id} {job['status']}: {job['step']} steps, policy version {job['policy_version']}, "
          f"{job['restarts']} restarts" + (f", last checkpoint {ckpt}" if ckpt else "")
          + (f", kept {job['kept']} and rejected {job['rejected']} samples" if job.get("spec", {}).get("rejection")
             else "")
          + (f"\nerror: {job['error']}" if job.get("error") else ""), flush=True)
    if job.get("work_dir"):
        print(f"job files: {job['work_dir']} (TensorBoard: {job['work_dir']}/tb)", flush=True)
    return job


class JobsCommand:
    help = "list, show, pause, resume, cancel a server's jobs; print their events or metrics"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=["list", "show", "pause", "resume", "cancel", "events", "metrics",
                                               "follow"])
        parser.add_argument("job_id", nargs="?", default=None)
        _common(parser)

    def run(self, args: argparse.Namespace, settings: Any) -> int:
        if args.action != "list" and not args.job_id:
            print(f"error: jobs {args.action} needs a job id", file=sys.stderr)
            return 2
        with _client(args, settings) as c:
            if args.action == "list":
                r = c.get("/jobs")
            elif args.action == "show":
                r = c.get(f"/jobs/{args.job_id}")
            elif args.action == "metrics":
                r = c.get(f"/jobs/{args.job_id}/metrics")
            elif args.action == "events":
                r = c.get(f"/jobs/{args.job_id}/events", params={"follow": "false"})
                if r.status_code == 200:
                    for line in r.text.splitlines():
                        if line.startswith("data: "):
                            print(line[6:])
                    return 0
            elif args.action == "follow":
                job = follow(c, args.job_id)
                return 0 if job["status"] == "completed" else 1
            else:
                r = c.post(f"/jobs/{args.job_id}/{args.action}")
            if r.status_code != 200:
                print(f"error ({r.status_code}): {_error(r)}", file=sys.stderr)
                return 1 if r.status_code >= 500 else 2
            data = r.json()
            if args.action == "list":
                for j in data.get("data", []):
                    print(f"{j['id']}  {j['status']:<9}  step {j['step']:>5}  version {j['policy_version']:>5}  "
                          f"{j.get('name') or ''}")
            else:
                print(json.dumps(data, indent=2))
        return 0
