"""``slime-server serve``: engines + sgl-router (as ``slime-server engines``) + the gateway on top.

The gateway runs in a thread with uvicorn's signal handlers off (``server/gateway_thread.py``): the main
thread owns the signals (``run_until_signal``): first the gateway stops taking
requests, then the engines and router go (no orphans), then the process exits 0.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_server.buffer.open import open_job_store
from slime_server.config import GatewaySettings, ServerSettings
from slime_server.jobs.spec import ACTIVE, JobSpec
from slime_server.online.attach import attach_online
from slime_server.online.preset import feedback_settings, online_job_spec
from slime_server.rollout.supervisor import EngineSupervisor
from slime_server.server.gateway_thread import GatewayThread, bind_listener
from slime_server.server.judge_server import start_judge_deployment, with_judge_cpus
from slime_server.server.launch import Deployment, rank_registry, resolve_model_path, start_trainer_group
from slime_server.utils.eval_args import parse_eval_data
from slime_server.utils.procs import run_until_signal
from slime_server.utils.shm import reap_recorded


@dataclass
class RunningServer:
    """What ``serve`` (and ``demo``) bring up, stopped in reverse order by ``stop``."""

    deployment: Any
    gateway: GatewayThread
    base_url: str
    jobs: Any = None  # JobManager
    judge: Any = None  # server.judge_server.JudgeDeployment (serve --online --judge-engine-model)
    supervisor: Any = None  # rollout.supervisor.EngineSupervisor

    def stop(self) -> None:
        try:
            self.gateway.stop()
            if self.supervisor is not None:
                self.supervisor.stop()
            if self.jobs is not None:
                self.jobs.shutdown()  # jobs stay active in the store: the next start resumes them
        finally:
            try:
                if self.judge is not None:
                    self.judge.stop()
            finally:
                self.deployment.shutdown()


def attach_jobs(gw: Any, settings: ServerSettings, model_path: str, engine_urls: Any,
                default_evals: list[tuple[str, str]] | None = None, eval_env: str | None = None,
                push_guard: Any = None, engine_api_key: str | None = None, deployment: Any = None) -> Any:
    """A JobManager over the gateway's store (jobs in the same SQLite file), restored from it.

    ``push_guard`` (``EngineSupervisor.updating_weights``) is entered by every job's loop around its weight
    pushes, so engines paused for an update are not judged unhealthy. ``deployment`` (its ``begin_training``/
    ``end_training``) moves the engines off the ranks' cores while a job's ranks run."""
    from slime_server.jobs.manager import JobManager  # lazy: loads torch

    tr = settings.trainer
    removed, freed = reap_recorded(rank_registry(tr))  # ranks of a server that was killed: their buckets
    if removed:
        print(f"removed {removed} shared-memory files ({freed / 1e6:.0f} MB) of trainer ranks that died with an "
              "earlier server", flush=True)

    def make_trainer(spec: JobSpec) -> Any:
        # the policy's log-probs at its sampling temperature (RL); SFT's NLL is the model's own distribution's
        sampled = spec.plays_episodes() and spec.data.temperature > 0 and spec.algorithm != "sft"
        temperature = spec.data.temperature if sampled else 1.0
        cores = deployment.begin_training() if deployment is not None else (None, None)
        return start_trainer_group(model_path, tr, optimizer=spec.optimizer, loss=spec.loss_config(),
                                   cores=cores, on_shutdown=deployment.end_training if deployment else None,
                                   temperature=temperature,
                                   max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
                                   engine_api_key=engine_api_key, reference=spec.needs_reference(),
                                   reference_path=spec.reference_model,
                                   critic=spec.critic if spec.algorithm == "ppo" else None, lora=spec.lora)

    def configure_loop(loop: Any) -> None:
        if push_guard is not None:
            loop.push_guard = push_guard
        if tr.colocate:  # the ranks share the engines' devices: never generate while they step
            loop.settings = loop.settings.model_copy(update={"sync": True})

    host = "127.0.0.1" if gw.settings.host in ("0.0.0.0", "::") else gw.settings.host
    jobs = JobManager(gw.store, open_job_store(gw.settings.db_path), make_trainer, engine_urls, tr.work_dir,
                      served_model=gw.model_name, loop_hook=configure_loop,
                      gateway_url=f"http://{host}:{gw.settings.port}/v1", api_key=gw.settings.api_key,
                      default_evals=default_evals or [], default_eval_env=eval_env, engine_api_key=engine_api_key,
                      model_path=model_path, lora_enabled=settings.engine.enable_lora,
                      max_lora_rank=settings.engine.max_lora_rank, adapters=gw.adapters.aliases,
                      routes_recorded=gw.settings.record_routed_experts, pipeline_stages=tr.pp_size)
    gw.jobs = jobs
    restored = jobs.restore()
    if restored:
        print(f"resumed jobs: {' '.join(restored)}", flush=True)
    return jobs


def start_online_job(jobs: Any, body: dict[str, Any]) -> None:
    """The online preset's live job, unless a job is already active (e.g. restored after a restart)."""
    active = [j.id for j in jobs.list() if j.status in ACTIVE]
    if active:
        print(f"online: job {active[0]} is active; not starting another", flush=True)
        return
    view = jobs.create(JobSpec.model_validate(body))
    print(f"online job: {view.id}", flush=True)


def start_server(settings: ServerSettings, gw_settings: GatewaySettings, log_dir: str | Path | None,
                 *, trainer: bool = True, default_evals: list[tuple[str, str]] | None = None,
                 eval_env: str | None = None, online: Any = None, online_job: dict[str, Any] | None = None,
                 judge_engine_model: str | None = None, judge_engines: int = 1) -> RunningServer:
    """Engines + router under Ray, the job manager (trainer ranks start per job), the gateway in front
    (and, with ``judge_engine_model``, the online judge on engines and a router of its own)."""
    from slime_server.api.auth import check_bind  # lazy: loads fastapi
    from slime_server.server.build import build_gateway  # lazy: loads fastapi, torch

    if check_bind(gw_settings.host, gw_settings.admin_api_key, gw_settings.insecure):  # before anything starts
        print(f"warning: serving on {gw_settings.host} with no admin key (--insecure-gateway)", flush=True)
    model_path = resolve_model_path(settings.engine.model)
    if gw_settings.served_model_name is None and model_path != settings.engine.model:  # "tiny", "smollm2"
        gw_settings = gw_settings.model_copy(update={"served_model_name": settings.engine.model})
    if judge_engine_model is not None:
        settings = with_judge_cpus(settings, judge_engines)
    listener = bind_listener(gw_settings.host, gw_settings.port)  # ours from here on (0: any free port)
    gw_settings = gw_settings.model_copy(update={"port": int(listener.getsockname()[1])})
    try:
        dep = Deployment.start(settings, log_dir=log_dir)
    except BaseException:
        listener.close()
        raise
    jobs = judge = supervisor = None
    try:
        print(f"router_url: {dep.router_url}", flush=True)
        if judge_engine_model is not None and online is not None:
            judge = start_judge_deployment(settings, judge_engine_model, judge_engines, dep.log_dir)
            online = online.model_copy(update={"judge": online.judge.model_copy(
                update={"base_url": judge.base_url, "model": None, "api_key": "none"})})
            print(f"judge_base_url: {judge.base_url} (router {judge.deployment.router_url}, "
                  f"{judge_engines} engine(s), calls recorded in {judge.db_path})", flush=True)
        app = build_gateway(dep.router_url, model_path, gw_settings, engine_api_key=dep.engine_api_key)
        supervisor = EngineSupervisor(lambda: dep.engine_urls, dep.router, api_key=dep.engine_api_key)
        if trainer:  # weights go to the engines in rotation; a restarted one is caught up on its own
            jobs = attach_jobs(app.state.gw, settings, model_path, supervisor.serving_urls, default_evals, eval_env,
                               push_guard=supervisor.updating_weights, engine_api_key=dep.engine_api_key,
                               deployment=dep)
            supervisor.catch_up = jobs.catch_up_engine
        supervisor.start()
        if online is not None:
            attach_online(app.state.gw, online, gw_settings)
        gateway = GatewayThread(app, gw_settings.host, gw_settings.port, listener).start()
        if online_job is not None and jobs is not None:
            start_online_job(jobs, online_job)
    except BaseException:
        listener.close()
        if supervisor is not None:
            supervisor.stop()
        if jobs is not None:
            jobs.shutdown()
        if judge is not None:
            judge.stop()
        dep.shutdown()
        raise
    return RunningServer(dep, gateway, f"http://{gw_settings.host}:{gw_settings.port}/v1", jobs, judge, supervisor)


class ServeCommand:
    help = "serve the OpenAI-compatible /v1 API over engines behind the sgl-router, recording trajectories"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default=None, help="gateway host (default: settings gateway.host)")
        parser.add_argument("--port", type=int, default=None, help="gateway port (default: settings gateway.port)")
        parser.add_argument("--api-key", default=None, help="protect /v1 with this Bearer key")
        parser.add_argument("--admin-api-key", default=None, help="key for /jobs (default: --api-key)")
        parser.add_argument("--no-trainer", action="store_true", help="serve and record only (no /jobs)")
        parser.add_argument("--db-path", default=None, help="SQLite trajectory store file")
        parser.add_argument("--log-dir", default=None, help="engine and router logs (default: a temp dir)")
        parser.add_argument("--eval-data", action="append", default=[], metavar="NAME=PATH",
                            help="JSONL eval set played greedily on a schedule for every job that names none "
                                 "(repeatable); environment: --eval-env or the job's data.environment")
        parser.add_argument("--eval-env", default=None, help="environment of the --eval-data sets")
        # online learning: the settings' online section (--online, --judge-url, ... are settings flags)

    def run(self, args: argparse.Namespace, settings: ServerSettings) -> int:
        evals = parse_eval_data(args.eval_data)
        section = settings.online
        online = feedback_settings(section) if section.enabled else None
        if section.judge_engine_model is not None and not section.enabled:
            raise SystemExit("--judge-engine-model (online.judge_engine_model) needs --online")

        overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key),
                                       ("admin_api_key", args.admin_api_key), ("db_path", args.db_path))
                     if v is not None}
        gw_settings = settings.gateway.model_copy(update=overrides)

        def start() -> RunningServer:
            running = start_server(settings, gw_settings, args.log_dir, trainer=not args.no_trainer,
                                   default_evals=evals, eval_env=args.eval_env, online=online,
                                   online_job=online_job_spec(section) if section.enabled and not args.no_trainer
                                   else None,
                                   judge_engine_model=section.judge_engine_model, judge_engines=section.judge_engines)
            print(f"openai_base_url: {running.base_url}", flush=True)
            return running

        code = run_until_signal(start, lambda running: running.stop())
        print("stopped", flush=True)
        return code
