"""Training jobs: what a job is (``JobSpec``), its state machine, and the manager that runs them.

    queued -> running <-> paused
                 |          |
                 v          v
     completed / failed / cancelled        (terminal; the data stays in the buffer)

A job trains the served policy on finished, rewarded trajectories (``data.source = "live"``: any
traffic through ``/v1`` whose session got a reward). It runs ``trainer/loop.py`` in a thread of
the control plane; the Megatron ranks are Ray actors built by ``make_trainer``. Everything a
restart needs (spec, status, loop state with its checkpoints) is written to the job store after
every step, so ``JobManager.restore`` picks running jobs up where their last checkpoint left them.

Only one job trains at a time: there is one served policy, and two jobs pushing weights into the
same engines would fight. A second active job is refused (409).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, model_validator

from slime_server.buffer.job_store import EventRow, JobRow, MetricsRow, SQLiteJobStore
from slime_server.buffer.store import TrajectoryStore
from slime_server.job_logging import JobLog, WandbSpec, WandbUnavailable, require_wandb
from slime_server.trainer.advantages import AdvantageConfig, Estimator
from slime_server.trainer.loop import EngineControl, LoopSettings, LoopState, Trainer, TrainLoop
from slime_server.trainer.losses import LossConfig
from slime_server.trainer.optimizer import OptimizerSettings

log = logging.getLogger(__name__)

JobStatus = Literal["queued", "running", "paused", "completed", "failed", "cancelled"]
ACTIVE: frozenset[str] = frozenset({"queued", "running", "paused"})
Algorithm = Literal["grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]

JOB_STEP = Gauge("slime_job_step", "optimizer steps taken", ["job"])
JOB_VERSION = Gauge("slime_job_policy_version", "policy version of the job's trainer", ["job"])
JOB_METRIC = Gauge("slime_job_metric", "last value of a training metric", ["job", "name"])
JOB_DROPPED = Counter("slime_job_dropped_trajectories_total", "trajectories never trained on", ["job", "reason"])
ADMISSION_REJECTED = Counter("slime_admission_rejected_total", "requests answered 429 by buffer pacing")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataSpec(_Strict):
    """``live``: train on whatever rewarded traffic reaches /v1. ``dataset``: the job also plays the
    environment's episodes on its dataset through this server's /v1 (the agent runner, in-process)."""

    source: Literal["live", "dataset"] = "live"
    environment: str | None = Field(None, description="built-in name or module:attr (source=dataset)")
    dataset: str | None = Field(None, description="JSONL path; default: the environment's generated rows")
    num_prompts: int = Field(256, ge=1, description="rows generated when no dataset is given")
    seed: int = 0
    concurrency: int = Field(8, ge=1, description="episodes in flight")
    temperature: float = Field(1.0, ge=0)
    max_tokens: int = Field(64, ge=1)


class PacingSpec(_Strict):
    max_buffered: int = Field(256, ge=1, description="unconsumed rewarded trajectories before /v1 answers 429")
    retry_after_s: float = Field(2.0, gt=0)


class EvalSpec(_Strict):
    """An evaluation set: episodes through the same runner (greedy by default, or sampled with fixed
    seeds: the same random numbers for every policy version), serve-only, never trained on."""

    name: str = Field(min_length=1, max_length=100)
    environment: str
    dataset: str | None = Field(None, description="JSONL path; default: the environment's generated rows")
    num_prompts: int = Field(32, ge=1)
    seed: int = 12345
    every_steps: int = Field(10, ge=1, description="evaluate after every N training steps (and at step 0)")
    max_tokens: int = Field(64, ge=1)
    concurrency: int = Field(8, ge=1)
    temperature: float = Field(0.0, ge=0, description="0 = greedy; > 0 samples with seeds from `seed`")

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        from slime_server.envs.base import get_environment

        get_environment(self.environment)
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise ValueError(f"eval dataset {self.dataset!r} is not a file")
        return self


# estimators whose baseline is the group mean (a group of one learns nothing)
GROUP_BASELINES = ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus_baseline")


class JobSpec(_Strict):
    """``POST /jobs`` body."""

    name: str | None = Field(None, max_length=200)
    base_model: str | None = Field(None, description="must be the served model (a live job trains it)")
    algorithm: Algorithm = "reinforce_plus_plus"
    data: DataSpec = Field(default_factory=DataSpec)
    loop: LoopSettings = Field(default_factory=LoopSettings)
    loss: dict[str, Any] = Field(default_factory=dict, description="LossConfig overrides (eps_clip, kl_coef, ...)")
    optimizer: OptimizerSettings = Field(default_factory=lambda: OptimizerSettings(lr=1e-5))
    pacing: PacingSpec = Field(default_factory=PacingSpec)
    max_tokens_per_micro_batch: int | None = Field(None, gt=0, description="default: the server's trainer setting")
    eval: list[EvalSpec] = Field(default_factory=list, description="evaluated on a schedule, per policy version")
    wandb: WandbSpec | None = Field(None, description="also log the job's metrics to Weights & Biases "
                                    "(needs the wandb package on the server; TensorBoard files are always written)")

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.data.source == "dataset":
            from slime_server.envs.base import get_environment

            if not self.data.environment:
                raise ValueError("data.source 'dataset' needs data.environment (e.g. 'calculator')")
            get_environment(self.data.environment)  # unknown names fail at submit time
            if self.data.dataset is not None and not Path(self.data.dataset).is_file():
                raise ValueError(f"data.dataset {self.data.dataset!r} is not a file")
            need = self.loop.batch_size + self.data.concurrency
            if self.pacing.max_buffered < need:
                # the buffer holds < batch_size samples of complete groups plus the members of the groups
                # in flight (< concurrency); a smaller limit can pace out the episodes that would complete a
                # group while the trainer waits for complete groups: a deadlock
                raise ValueError(f"pacing.max_buffered ({self.pacing.max_buffered}) must be >= loop.batch_size + "
                                 f"data.concurrency ({need}) for a dataset job")
        if self.loop.n_samples_per_prompt == 1 and self.estimator() in GROUP_BASELINES:
            raise ValueError(f"algorithm {self.algorithm!r} subtracts its group's mean reward: with "
                             "loop.n_samples_per_prompt 1 every advantage is 0; use 'reinforce_plus_plus' (batch "
                             "baseline) or groups of n >= 2")
        LossConfig(**self.loss_config())  # fail at submit time, not in the trainer
        return self

    def estimator(self) -> Estimator:
        return "grpo" if self.algorithm == "ppo" else self.algorithm

    def loss_config(self) -> dict[str, Any]:
        return {"loss_type": self.algorithm if self.algorithm != "dr_grpo" else "grpo", **self.loss}

    def loop_settings(self) -> LoopSettings:
        adv = self.loop.advantage.model_copy(update={"estimator": self.estimator()})
        return self.loop.model_copy(update={"advantage": AdvantageConfig.model_validate(adv.model_dump())})


class JobView(BaseModel):
    """``GET /jobs/{id}``."""

    id: str
    object: Literal["job"] = "job"
    name: str | None
    status: str
    spec: dict[str, Any]
    step: int
    policy_version: int
    checkpoints: list[dict[str, Any]]
    dropped_stale: int
    dropped_zero_variance: int
    downweighted: int
    restarts: int
    error: str | None
    created_at: float
    updated_at: float


class JobError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status_code, self.code = status, code


def view(row: JobRow) -> JobView:
    st = LoopState.model_validate(row.state)
    return JobView(id=row.id, name=row.spec.get("name"), status=row.status, spec=row.spec, step=st.step,
                   policy_version=st.version, checkpoints=[c.model_dump() for c in st.checkpoints],
                   dropped_stale=st.dropped_stale, dropped_zero_variance=st.dropped_zero_variance,
                   downweighted=st.downweighted, restarts=st.restarts, error=row.error,
                   created_at=row.created_at, updated_at=row.updated_at)


MakeTrainer = Callable[[JobSpec], Trainer]


class _Running:
    def __init__(self, loop: TrainLoop, thread: threading.Thread, tb: Any, evaluator: Evaluator) -> None:
        self.loop, self.thread, self.tb, self.evaluator = loop, thread, tb, evaluator
        self.driver: threading.Thread | None = None


class DatasetDriver:
    """Plays a dataset job's episodes through /v1 while its loop runs (paused with it, stops with it)."""

    def __init__(self, spec: JobSpec, loop: TrainLoop, base_url: str, api_key: str | None,
                 on_event: Callable[[str, dict[str, Any]], None]) -> None:
        from slime_server.agents.runner import AgentRunner, RunnerSettings
        from slime_server.envs.base import get_environment, load_jsonl

        d = spec.data
        env = get_environment(d.environment or "")
        self.rows = load_jsonl(d.dataset) if d.dataset else env.default_dataset(d.num_prompts, seed=d.seed)
        if not self.rows:
            raise ValueError("the dataset has no rows")
        self.per_round = max(1, d.concurrency // spec.loop.n_samples_per_prompt)
        self.runner = AgentRunner(env, RunnerSettings(
            base_url=base_url, api_key=api_key or "none", n_samples_per_prompt=spec.loop.n_samples_per_prompt,
            concurrency=d.concurrency, temperature=d.temperature, max_tokens=d.max_tokens))
        self.loop, self.on_event = loop, on_event
        self.episodes = 0

    def run(self) -> None:
        import asyncio

        i = 0
        while not self.loop.stop.is_set():
            if self.loop.paused.is_set():
                self.loop.stop.wait(0.2)
                continue
            chunk = [self.rows[(i + k) % len(self.rows)] for k in range(self.per_round)]
            i += self.per_round
            try:
                summary = asyncio.run(self.runner.run(chunk))
            except Exception as e:  # noqa: BLE001 - the server may be going down; retry unless stopping
                log.warning("dataset episodes failed: %r", e)
                self.loop.stop.wait(1.0)
                continue
            self.episodes += summary.episodes
            self.on_event("episodes", {"episodes": summary.episodes, "total": self.episodes,
                                       "mean_reward": summary.mean_reward, "success_rate": summary.success_rate,
                                       "errors": summary.errors, "version": self.loop.state.version})


class JobManager:
    """Creates, controls, persists and restores jobs; answers the gateway's pacing question."""

    def __init__(self, store: TrajectoryStore, jobs: SQLiteJobStore, make_trainer: MakeTrainer,
                 engine_urls: Callable[[], list[str]], work_dir: str | Path, *, served_model: str | None = None,
                 loop_hook: Callable[[TrainLoop], None] | None = None, gateway_url: str | None = None,
                 api_key: str | None = None, default_evals: list[tuple[str, str]] | None = None,
                 default_eval_env: str | None = None, engine_api_key: str | None = None) -> None:
        self.store = store
        self.engine_api_key = engine_api_key  # the engines' key, for the loop's pause/continue/version calls
        self.default_evals = default_evals or []  # (name, JSONL path) from `serve --eval-data`
        self.default_eval_env = default_eval_env
        self.gateway_url = gateway_url  # this server's /v1, for dataset jobs' in-process agent runner
        self.api_key = api_key
        self.jobs = jobs
        self.make_trainer = make_trainer
        self.engine_urls = engine_urls
        self.work_dir = Path(work_dir)
        self.served_model = served_model
        self.loop_hook = loop_hook or (lambda loop: None)
        self._running: dict[str, _Running] = {}
        self._lock = threading.RLock()
        self._subscribers: list[Callable[[str, EventRow], None]] = []
        self._buffered_cache: tuple[float, int] = (0.0, 0)

    # ---------------------------------------------------------------- REST operations
    def with_default_evals(self, spec: JobSpec) -> JobSpec:
        """The server's ``--eval-data`` sets, for a job that names no eval set of its own."""
        env = self.default_eval_env or (spec.data.environment if spec.data.source == "dataset" else None)
        if spec.eval or not self.default_evals or env is None:
            return spec
        return spec.model_copy(update={"eval": [EvalSpec(name=name, environment=env, dataset=path)
                                                for name, path in self.default_evals]})

    def create(self, spec: JobSpec) -> JobView:
        spec = self.with_default_evals(spec)
        if spec.wandb is not None and spec.wandb.mode != "disabled":
            try:
                require_wandb()
            except WandbUnavailable as e:
                raise JobError(400, str(e), "wandb_not_installed") from e
        if spec.base_model is not None and self.served_model is not None and spec.base_model != self.served_model:
            raise JobError(400, f"base_model {spec.base_model!r} is not the served model {self.served_model!r}; "
                           "a live job trains the policy the engines serve", "invalid_value")
        with self._lock:
            active = [r.id for r in self.jobs.list_jobs() if r.status in ACTIVE]
            if active:
                raise JobError(409, f"job {active[0]} is still active; cancel it first (one policy, one trainer)",
                               "job_active")
            job_id = f"job-{uuid.uuid4().hex[:16]}"
            row = self.jobs.insert_job(job_id, spec.model_dump(mode="json"), "queued", LoopState().model_dump())
            self._event(job_id, "created", {"spec": row.spec})
            try:
                self._launch(row)
            except Exception as e:  # a job that cannot start must not stay "queued" and block the next one
                self.jobs.update_job(job_id, status="failed", error=repr(e)[:2000])
                self._event(job_id, "failed", {"error": repr(e)[:2000]})
                if isinstance(e, JobError):
                    raise
                raise JobError(400, f"the job cannot start: {e}", "job_start_failed") from e
        return self.get(job_id)

    def get(self, job_id: str) -> JobView:
        return view(self._row(job_id))

    def list(self) -> list[JobView]:
        return [view(r) for r in self.jobs.list_jobs()]

    def pause(self, job_id: str) -> JobView:
        return self._transition(job_id, {"running": "paused", "queued": "paused"}, "pause",
                                lambda run: run.loop.paused.set())

    def resume(self, job_id: str) -> JobView:
        return self._transition(job_id, {"paused": "running"}, "resume", lambda run: run.loop.paused.clear())

    def cancel(self, job_id: str) -> JobView:
        return self._transition(job_id, {s: "cancelled" for s in ACTIVE}, "cancel", lambda run: run.loop.stop.set())

    def catch_up_engine(self, url: str) -> bool:
        """Push the running job's current weights to one (restarted) engine; False if no job can."""
        for run in list(self._running.values()):
            if run.thread.is_alive() and run.loop.sync_engine(url):
                return True
        return False

    def metrics(self, job_id: str, since_step: int = 0) -> list[MetricsRow]:
        self._row(job_id)
        return self.jobs.metrics(job_id, since_step)

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRow]:
        self._row(job_id)
        return self.jobs.events(job_id, after_seq)

    def request_checkpoint(self, job_id: str, timeout: float = 300.0) -> dict[str, Any]:
        """Checkpoint between two steps (the loop's thread owns the trainer); waits for it."""
        row = self._row(job_id)
        run = self._running.get(job_id)
        if run is None or row.status not in ("running", "paused"):
            raise JobError(409, f"job {job_id} is {row.status}: nothing to checkpoint", "job_not_running")
        before = len(run.loop.state.checkpoints)
        run.loop.checkpoint_requested.set()
        with run.loop.checkpoint_done:
            if not run.loop.checkpoint_done.wait_for(lambda: len(run.loop.state.checkpoints) > before, timeout):
                raise JobError(503, "the checkpoint did not finish in time", "checkpoint_timeout")
        return run.loop.state.checkpoints[-1].model_dump()

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self.get(job_id).checkpoints

    # ---------------------------------------------------------------- pacing
    def retry_after(self, serve_only: bool) -> float | None:
        """Seconds a *training* request should wait (None: admit). Serve-only traffic is never paced."""
        if serve_only:
            return None
        with self._lock:
            runs = [(jid, r) for jid, r in self._running.items() if not r.loop.stop.is_set()]
        if not runs:
            return None
        spec = JobSpec.model_validate(self._row(runs[0][0]).spec)
        t, n = self._buffered_cache
        if time.monotonic() - t > 0.5:
            n = self.store.stats().unconsumed_finished_rewarded
            self._buffered_cache = (time.monotonic(), n)
        if n >= spec.pacing.max_buffered:
            ADMISSION_REJECTED.inc()
            return spec.pacing.retry_after_s
        return None

    # ---------------------------------------------------------------- lifecycle
    def restore(self) -> list[str]:
        """Start again every job that was active when the server stopped (from its last checkpoint)."""
        restored = []
        for row in self.jobs.list_jobs():
            if row.status in ACTIVE:
                self._event(row.id, "restored", {"status": row.status})
                self._launch(row, restoring=True)
                restored.append(row.id)
        return restored

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the loops (jobs stay active in the store, so a restart resumes them)."""
        with self._lock:
            runs = list(self._running.items())
        for _, run in runs:
            run.loop.stop.set()
        for _, run in runs:
            run.thread.join(timeout)

    def subscribe(self, fn: Callable[[str, EventRow], None]) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    # ---------------------------------------------------------------- internals
    def _row(self, job_id: str) -> JobRow:
        row = self.jobs.get_job(job_id)
        if row is None:
            raise JobError(404, f"unknown job '{job_id}'", "job_not_found")
        return row

    def _event(self, job_id: str, kind: str, data: dict[str, Any]) -> None:
        ev = self.jobs.add_event(job_id, kind, data)
        for fn in list(self._subscribers):
            try:
                fn(job_id, ev)
            except Exception:  # noqa: BLE001 - a broken listener must not break the job
                log.exception("event subscriber failed")

    def _transition(self, job_id: str, allowed: dict[str, str], verb: str, act: Callable[[_Running], None]) -> JobView:
        with self._lock:
            row = self._row(job_id)
            target = allowed.get(row.status)
            if target is None:
                raise JobError(409, f"job {job_id} is {row.status}; cannot {verb} it", "invalid_job_state")
            self.jobs.update_job(job_id, status=target)
            run = self._running.get(job_id)
            if run is not None:
                act(run)
            self._event(job_id, target if verb != "resume" else "resumed", {"status": target})
        if target == "cancelled" and run is not None:
            run.thread.join(timeout=120)
        return self.get(job_id)

    def _launch(self, row: JobRow, restoring: bool = False) -> None:
        spec = JobSpec.model_validate(row.spec)
        job_dir = self.work_dir / row.id
        job_dir.mkdir(parents=True, exist_ok=True)
        engines = EngineControl(self.engine_urls, api_key=self.engine_api_key)

        def on_step(state: LoopState, metrics: dict[str, float]) -> None:
            self.jobs.update_job(row.id, state=state.model_dump())
            self.jobs.add_metrics(row.id, state.step, metrics)
            JOB_STEP.labels(row.id).set(state.step)
            JOB_VERSION.labels(row.id).set(state.version)
            for name in ("loss", "reward_mean", "kl", "clip_fraction", "staleness_mean", "tokens_per_s", "grad_norm"):
                if name in metrics:
                    JOB_METRIC.labels(row.id, name).set(metrics[name])
            tb.add_scalars(metrics, state.step)
            tb.flush()
            self._event(row.id, "step", {"step": state.step, "version": state.version,
                                         **{k: metrics[k] for k in ("loss", "reward_mean") if k in metrics}})
            evaluator.maybe_run(state.step, state.version)

        def on_event(kind: str, data: dict[str, Any]) -> None:
            if kind in ("checkpoint", "dropped", "resumed", "trainer_ready"):
                self.jobs.update_job(row.id, state=loop.state.model_dump())
            self._event(row.id, kind, data)
            if kind == "trainer_ready" and data.get("step") == 0:  # the base policy's score, before training
                evaluator.maybe_run(0, int(data.get("version", 0)))

        loop = TrainLoop(self.store, lambda: self.make_trainer(spec), engines, spec.loop_settings(),
                         job_dir / "checkpoints", state=LoopState.model_validate(row.state), on_step=on_step,
                         on_event=on_event, job_id=row.id)
        if row.status == "paused":
            loop.paused.set()

        self.loop_hook(loop)
        driver = None
        if spec.data.source == "dataset":
            if self.gateway_url is None:
                raise JobError(400, "this server cannot run dataset jobs (no gateway URL)", "no_gateway")
            driver = DatasetDriver(spec, loop, self.gateway_url, self.api_key, lambda k, d: self._event(row.id, k, d))
        tb = self._job_log(row, spec, job_dir, restoring)  # last: nothing after it can fail and leak a W&B run
        evaluator = Evaluator(spec.eval, self.gateway_url, self.api_key, lambda k, d: self._event(row.id, k, d), tb)
        run = _Running(loop, threading.Thread(target=self._run, args=(row.id,), name=f"job-{row.id}", daemon=True), tb,
                       evaluator)
        if driver is not None:
            run.driver = threading.Thread(target=driver.run, name=f"driver-{row.id}", daemon=True)
        with self._lock:
            self._running[row.id] = run
        run.thread.start()
        if run.driver is not None:
            run.driver.start()

    def _job_log(self, row: JobRow, spec: JobSpec, job_dir: Path, restoring: bool) -> JobLog:
        """TensorBoard always; W&B if asked. A new job that cannot open its W&B run does not start
        (400); a restored one goes on without W&B (the server must come back up)."""
        try:
            return JobLog.open(job_dir, row.id, name=spec.name, wandb=spec.wandb, config=row.spec)
        except Exception as e:
            if not restoring:
                raise JobError(400, f"the job cannot open its W&B run: {e!r}"[:2000], "wandb_failed") from e
            log.exception("job %s: W&B logging is off after the restart", row.id)
            self._event(row.id, "wandb_failed", {"error": repr(e)[:500]})
            return JobLog.open(job_dir, row.id)

    def _run(self, job_id: str) -> None:
        run = self._running[job_id]
        loop = run.loop
        dropped = (loop.state.dropped_stale, loop.state.dropped_zero_variance)
        try:
            if self._row(job_id).status == "queued":
                self.jobs.update_job(job_id, status="running")
                self._event(job_id, "started", {})
            loop.run()
            final = self._row(job_id).status
            if final in ("running", "paused") and not loop.stop.is_set():  # max_steps reached
                loop.checkpoint()
                self.jobs.update_job(job_id, status="completed", state=loop.state.model_dump())
                self._event(job_id, "completed", {"step": loop.state.step})
            else:
                self.jobs.update_job(job_id, state=loop.state.model_dump())
        except Exception as e:  # noqa: BLE001 - recorded on the job, never lost in a thread
            log.exception("job %s failed", job_id)
            self.jobs.update_job(job_id, status="failed", state=loop.state.model_dump(), error=repr(e)[:2000])
            self._event(job_id, "failed", {"error": repr(e)[:2000]})
        finally:
            JOB_DROPPED.labels(job_id, "stale").inc(loop.state.dropped_stale - dropped[0])
            JOB_DROPPED.labels(job_id, "zero_variance").inc(loop.state.dropped_zero_variance - dropped[1])
            try:
                loop.close()
            except Exception:  # noqa: BLE001
                log.exception("job %s: trainer shutdown failed", job_id)
            loop.stop.set()  # the dataset driver (if any) stops with the loop
            if run.driver is not None:
                run.driver.join(timeout=120)
            run.evaluator.close()
            loop.engines.close()
            run.tb.close()
            with self._lock:
                self._running.pop(job_id, None)


class Evaluator:
    """Runs the job's eval sets in the background (one round at a time) and reports per version."""

    def __init__(self, specs: list[EvalSpec], base_url: str | None, api_key: str | None,
                 on_event: Callable[[str, dict[str, Any]], None], tb: Any) -> None:
        self.specs, self.base_url, self.api_key, self.on_event, self.tb = specs, base_url, api_key, on_event, tb
        self._lock = threading.Lock()
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pending: tuple[list[EvalSpec], int, int] | None = None  # the newest round that came due meanwhile

    def maybe_run(self, step: int, version: int) -> None:
        due = [e for e in self.specs if step % e.every_steps == 0]
        if not due or self.base_url is None:
            return
        with self._lock:
            if self._closed:
                return
            if self._running:
                self._pending = (due, step, version)
                return
            self._running = True
            self._thread = threading.Thread(target=self._loop, args=(due, step, version), name="eval", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 120.0) -> None:
        """No new rounds; wait for the one in progress (its sessions must not outlive the job)."""
        with self._lock:
            self._closed, self._pending = True, None
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _loop(self, specs: list[EvalSpec], step: int, version: int) -> None:
        job: tuple[list[EvalSpec], int, int] | None = (specs, step, version)
        while job is not None:
            self._run(*job)
            with self._lock:
                job, self._pending = (None if self._closed else self._pending), None
                if job is None:
                    self._running = False

    def _run(self, specs: list[EvalSpec], step: int, version: int) -> None:
        import asyncio

        from slime_server.agents.runner import AgentRunner, RunnerSettings
        from slime_server.envs.base import get_environment, load_jsonl

        try:
            for e in specs:
                env = get_environment(e.environment)
                rows = load_jsonl(e.dataset)[: e.num_prompts] if e.dataset else env.default_dataset(e.num_prompts,
                                                                                                      seed=e.seed)
                runner = AgentRunner(env, RunnerSettings(
                    base_url=self.base_url or "", api_key=self.api_key or "none", n_samples_per_prompt=1,
                    concurrency=e.concurrency, temperature=e.temperature, max_tokens=e.max_tokens, seed=e.seed,
                    post_rewards=False, serve_only=True))
                try:
                    summary = asyncio.run(runner.run(rows))
                except Exception as exc:  # noqa: BLE001 - reported, never kills the job
                    self.on_event("eval_failed", {"name": e.name, "step": step, "error": repr(exc)[:500]})
                    continue
                self.on_event("eval", {"name": e.name, "step": step, "version": version,
                                       "success_rate": summary.success_rate, "mean_reward": summary.mean_reward,
                                       "episodes": summary.episodes, "errors": summary.errors})
                if self.tb is not None:
                    self.tb.add_scalar(f"eval/{e.name}/success_rate", summary.success_rate, step)
                    self.tb.flush()
        except Exception as exc:  # noqa: BLE001 - an eval must never take the job down
            self.on_event("eval_failed", {"step": step, "error": repr(exc)[:500]})
