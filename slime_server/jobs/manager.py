"""The job state machine and the manager that runs jobs (what a job is: ``spec.py``).

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

import json
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slime_server.buffer.adapter_store import AdapterStore
from slime_server.buffer.job_store import EventRow, JobRow, JobStore, MetricsRow
from slime_server.buffer.store import TrajectoryStore
from slime_server.job_logging import JobLog, WandbUnavailable, require_wandb
from slime_server.jobs.adapters import (
    alias_of,
    check_serving,
    publication,
    publishes_adapter,
    restore_published,
)
from slime_server.jobs.errors import JobError
from slime_server.jobs.metrics import JOB_DROPPED, JOB_METRIC, JOB_STEP, JOB_VERSION
from slime_server.jobs.runners import DatasetDriver, Evaluator
from slime_server.jobs.spec import ACTIVE, EvalSpec, JobSpec, JobView, PacingSpec, view
from slime_server.trainer.grammar_masks import GrammarMasker
from slime_server.trainer.loop import BatchSource, EngineControl, Trainer, TrainLoop
from slime_server.trainer.selection import Rejection
from slime_server.trainer.settings import LoopState
from slime_server.trainer.sources import ConversationSource, ReplaySource


def is_moe(model_path: str) -> bool:
    """Whether the checkpoint's config names routed experts (Qwen3-MoE's ``num_experts``, which transformers 5 saves
    as ``num_local_experts``; DeepSeek's ``n_routed_experts``); a directory without a config counts as one (the
    trainer then decides)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return True
    fields = json.loads(config.read_text())
    return any(int(fields.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


log = logging.getLogger(__name__)


MakeTrainer = Callable[[JobSpec], Trainer]


class _Running:
    def __init__(self, loop: TrainLoop, thread: threading.Thread, tb: Any, evaluator: Evaluator) -> None:
        self.loop, self.thread, self.tb, self.evaluator = loop, thread, tb, evaluator
        self.driver: threading.Thread | None = None
        self.dataset: DatasetDriver | None = None  # what the driver thread runs (stopped at the job's end)
        self.rollout_only: Callable[[], None] | None = None  # train false: the job is this, not the loop
        self.pacing: PacingSpec | None = None  # /v1's pacing while it runs: only a job that consumes the buffer


class JobManager:
    """Creates, controls, persists and restores jobs; answers the gateway's pacing question."""

    def __init__(self, store: TrajectoryStore, jobs: JobStore, make_trainer: MakeTrainer,
                 engine_urls: Callable[[], list[str]], work_dir: str | Path, *, served_model: str | None = None,
                 loop_hook: Callable[[TrainLoop], None] | None = None, gateway_url: str | None = None,
                 api_key: str | None = None, default_evals: list[tuple[str, str]] | None = None,
                 default_eval_env: str | None = None, engine_api_key: str | None = None,
                 model_path: str | None = None, lora_enabled: bool = False, max_lora_rank: int | None = None,
                 adapters: AdapterStore | None = None, routes_recorded: bool = False, pipeline_stages: int = 1,
                 ) -> None:
        self.store = store
        self.pipeline_stages = pipeline_stages  # the trainer's PP size (R2 records routes on one stage only)
        self.routes_recorded = routes_recorded  # the gateway records MoE routes (what routing replay trains with)
        self.lora_enabled, self.max_lora_rank = lora_enabled, max_lora_rank  # what the engines can serve
        self.adapters = adapters  # published adapters' aliases (LoRA jobs publishing adapters)
        self.model_path = model_path  # the served model's directory: its tokenizer renders SFT conversations
        self.engine_api_key = engine_api_key  # the engines' key, for the loop's pause/continue/version calls
        self.default_evals = default_evals or []  # (name, JSONL path) from `serve --eval-data`
        self.default_eval_env = default_eval_env
        self.gateway_url = gateway_url  # this server's /v1, for dataset jobs' in-process agent runner
        self.api_key = api_key
        self.jobs = jobs
        self.make_trainer = make_trainer
        self.engine_urls = engine_urls
        self.work_dir = Path(work_dir).resolve()
        self.served_model = served_model
        self.loop_hook = loop_hook or (lambda loop: None)
        self._running: dict[str, _Running] = {}
        self._lock = threading.RLock()
        self._subscribers: list[Callable[[str, EventRow], None]] = []

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
        check_serving(spec, self.lora_enabled, self.max_lora_rank)
        if spec.moe.routing_replay != "off" and self.model_path is not None and not is_moe(self.model_path):
            raise JobError(400, f"moe.routing_replay {spec.moe.routing_replay!r} replays a mixture-of-experts "
                           "model's routing; the served model has no experts (set it to 'off')", "invalid_value")
        if spec.moe.routing_replay == "trainer" and self.pipeline_stages > 1:
            raise JobError(400, "moe.routing_replay 'trainer' records the routing on one pipeline stage; this "
                           f"server's trainer has {self.pipeline_stages} (trainer.pp_size)", "invalid_value")
        if spec.moe.routing_replay == "rollout" and not self.routes_recorded:
            raise JobError(400, "moe.routing_replay 'rollout' trains with the engines' routed experts, which this "
                           "server does not record: start it with --enable-return-routed-experts "
                           "(engine.enable_return_routed_experts)", "routes_not_recorded")
        if publishes_adapter(spec) and self.adapters is None:
            raise JobError(400, "this server keeps no adapter aliases (no store path); set lora.publish to 'merged'",
                           "lora_not_enabled")
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
        return view(self._row(job_id), str(self.work_dir / job_id))

    def list(self) -> list[JobView]:
        return [view(r, str(self.work_dir / r.id)) for r in self.jobs.list_jobs()]

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

    def forget_user(self, job_id: str, alias: str, timeout: float = 300.0) -> dict[str, Any]:
        """A running per-user job forgets the user of adapter ``alias`` (its adapter is being deleted): between two
        steps, waited for (``TrainLoop.forget_user``)."""
        row = self._row(job_id)
        run = self._running.get(job_id)
        if run is None or row.status not in ("running", "paused") or run.loop.stop.is_set():
            raise JobError(409, f"job {job_id} is {row.status}: it cannot let go of '{alias}' now; cancel it first",
                           "job_active")
        if run.loop.users is None:
            raise JobError(409, f"job {job_id} still trains '{alias}'; cancel it first", "job_active")
        try:
            return run.loop.between_steps(lambda: run.loop.forget_user(alias), timeout)
        except TimeoutError:
            raise JobError(503, f"job {job_id} did not let go of '{alias}' in time", "forget_timeout") from None

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self.get(job_id).checkpoints

    # ---------------------------------------------------------------- pacing (the gateway's: gateway/pacing.py)
    def active_pacing(self) -> PacingSpec | None:
        """The running job's pacing spec (None: no job is training, so nothing is paced)."""
        with self._lock:
            paced = [r.pacing for r in self._running.values() if not r.loop.stop.is_set() and r.pacing is not None]
        return paced[0] if paced else None  # a job's spec never changes: no store read per request

    # ---------------------------------------------------------------- lifecycle
    def restore(self) -> list[str]:
        """Start again every job that was active when the server stopped (from its last checkpoint)."""
        restored = []
        rows = self.jobs.list_jobs()
        if self.adapters is not None:  # first: a restored job's episodes may name another job's alias
            engines = EngineControl(self.engine_urls, api_key=self.engine_api_key)
            try:
                restore_published(self.adapters, {r.id for r in rows if r.status in ACTIVE}, engines)
            finally:
                engines.close()
        for row in rows:
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
            if kind in ("checkpoint", "dropped", "resumed", "trainer_ready", "waiting", "user_forgotten"):
                self.jobs.update_job(row.id, state=loop.state.model_dump())
            self._event(row.id, kind, data)
            if kind == "trainer_ready" and data.get("step") == 0:  # the base policy's score, before training
                evaluator.maybe_run(0, int(data.get("version", 0)))

        loop = TrainLoop(self.store, lambda: self.make_trainer(spec), engines, spec.loop_settings(),
                         job_dir / "checkpoints", state=LoopState.model_validate(row.state), on_step=on_step,
                         on_event=on_event, job_id=row.id, source=self._source(spec),
                         supervised=spec.algorithm == "sft",
                         rejection=Rejection(**spec.rejection.model_dump()) if spec.rejection else None,
                         grammar_masker=GrammarMasker(self.model_path) if self.model_path else None,
                         adapter=publication(spec, row.id, self.adapters, engines, job_dir) if self.adapters else None)
        if row.status == "paused":
            loop.paused.set()

        self.loop_hook(loop)
        driver = None
        if spec.plays_episodes():
            if self.gateway_url is None:
                raise JobError(400, "this server cannot run dataset jobs (no gateway URL)", "no_gateway")
            driver = DatasetDriver(spec, loop, self.gateway_url, self.api_key, lambda k, d: self._event(row.id, k, d),
                                   adapter=alias_of(spec, row.id))
        tb = self._job_log(row, spec, job_dir, restoring)  # last: nothing after it can fail and leak a W&B run
        evaluator = Evaluator(spec.eval, self.gateway_url, self.api_key, lambda k, d: self._event(row.id, k, d), tb,
                              job_stop=loop.stop, adapter=alias_of(spec, row.id))
        run = _Running(loop, threading.Thread(target=self._run, args=(row.id,), name=f"job-{row.id}", daemon=True), tb,
                       evaluator)
        # rollout-only and file-fed jobs (SFT conversations, replay) consume nothing from the buffer
        run.pacing = spec.pacing if spec.train and (spec.data.source == "live" or spec.plays_episodes()) else None
        if driver is not None and not spec.train:
            run.rollout_only = lambda: driver.run(passes=spec.data.epochs)
        elif driver is not None:
            run.dataset = driver
            run.driver = threading.Thread(target=driver.run, name=f"driver-{row.id}", daemon=True)
        with self._lock:
            self._running[row.id] = run
        run.thread.start()
        if run.driver is not None:
            run.driver.start()

    def _source(self, spec: JobSpec) -> BatchSource | None:
        """The job's file of batches (SFT conversations, a replayed export); None: the live buffer."""
        d, loop = spec.data, spec.loop
        if d.source == "conversations":
            from transformers import AutoTokenizer

            if self.model_path is None:
                raise JobError(400, "this server cannot render conversations (no model path)", "no_model_path")
            return ConversationSource.from_file(
                d.dataset or "", AutoTokenizer.from_pretrained(self.model_path), batch_size=loop.batch_size,
                epochs=d.epochs, seed=d.seed, input_key=d.input_key, label_key=d.label_key, tools_key=d.tools_key,
                system_prompt=d.system_prompt)
        if d.source == "replay":
            return ReplaySource(d.dataset or "", batch_size=loop.batch_size, group_size=loop.n_samples_per_prompt,
                                job_id=d.replay_job)
        return None

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

    def _reached_end(self, job_id: str, loop: TrainLoop) -> bool:
        return self._row(job_id).status in ("running", "paused") and not loop.stop.is_set()

    def _wind_down(self, run: _Running) -> None:
        """A job that reached its end, before it is marked completed: its episodes stop (none may outlive
        it: whoever waits for ``completed`` may stop the server next), its last checkpoint is written, and
        the evaluation due at its last step runs and reports (after a round still in progress). A cancel
        meanwhile cuts the evaluation short."""
        if run.dataset is not None and run.driver is not None:
            run.dataset.stop()
            run.driver.join(timeout=120)
        if run.loop.trainer is not None:
            run.loop.checkpoint()
        run.evaluator.finish()

    def _run(self, job_id: str) -> None:
        run = self._running[job_id]
        loop = run.loop
        dropped = (loop.state.dropped_stale, loop.state.dropped_zero_variance, loop.state.dropped_incomplete)
        with self._lock:
            ending = [r.thread for i, r in self._running.items() if i != job_id]
        for thread in ending:  # a job that just ended lets go of its trainer first: one trainer at a time (its
            thread.join(timeout=120)  # cores go back, and its idle ranks can start this job: trainer.warm_ranks_s)
        try:
            with self._lock:  # read and write under the transitions' lock: a pause between the two stays a pause
                if self._row(job_id).status == "queued":
                    self.jobs.update_job(job_id, status="running")
                    self._event(job_id, "started", {})
            if run.rollout_only is not None:
                run.rollout_only()
            else:
                loop.run()
            if self._reached_end(job_id, loop):  # max_steps reached, or the data ran out
                self._wind_down(run)
            if self._reached_end(job_id, loop):  # not cancelled meanwhile
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
            JOB_DROPPED.labels(job_id, "incomplete_group").inc(loop.state.dropped_incomplete - dropped[2])
            loop.stop.set()  # first: the dataset driver plays no more rounds while the trainer shuts down
            try:
                loop.close()
            except Exception:  # noqa: BLE001
                log.exception("job %s: trainer shutdown failed", job_id)
            if run.driver is not None:
                run.driver.join(timeout=120)
            run.evaluator.close()
            loop.engines.close()
            run.tb.close()
            with self._lock:
                self._running.pop(job_id, None)
