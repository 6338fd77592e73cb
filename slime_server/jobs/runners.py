"""What runs beside a job's training loop: a dataset job's episodes played through ``/v1``
(``DatasetDriver``), and the job's eval rounds per policy version (``Evaluator``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from slime_server.agents.runner import AgentRunner, RunnerSettings
from slime_server.envs.base import get_environment, load_jsonl
from slime_server.jobs.spec import EvalSpec, JobSpec
from slime_server.trainer.loop import TrainLoop

log = logging.getLogger(__name__)


class _Either:
    """Set when any of its events is (a driver stops with its loop's stop, or alone at the job's end)."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set() and time.monotonic() < deadline:
            self.events[0].wait(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.is_set()


DEFAULT_PROMPTS = 256  # rows a dataset job generates when data.num_prompts is unset


class DatasetDriver:
    """Plays a dataset job's episodes through /v1 while its loop runs (paused with it, stops with it)."""

    def __init__(self, spec: JobSpec, loop: TrainLoop, base_url: str, api_key: str | None,
                 on_event: Callable[[str, dict[str, Any]], None], adapter: str | None = None) -> None:
        d = spec.data
        settings = RunnerSettings(
            base_url=base_url, api_key=api_key or "none", n_samples_per_prompt=spec.loop.n_samples_per_prompt,
            concurrency=d.concurrency, temperature=d.temperature, max_tokens=d.max_tokens, adapter=adapter)
        self.runner: Any
        if d.source == "verifiers":
            from slime_server.agents.verifiers_runner import (  # lazy: verifiers (4 s)
                VerifiersRunner,
                load,
                rows_of,
            )

            env = load(d.environment or "", d.env_args)
            n = d.num_prompts or -1  # set: at most that many rows
            self.rows: Sequence[Any] = rows_of(env, d.seed, n)
            self.runner = VerifiersRunner(env, settings, d.sampling_args)
        else:
            builtin = get_environment(d.environment or "")
            if d.dataset:  # data.num_prompts, when set, takes its first rows
                self.rows = load_jsonl(d.dataset)[: d.num_prompts]
            else:
                self.rows = builtin.default_dataset(d.num_prompts or DEFAULT_PROMPTS, seed=d.seed)
            self.runner = AgentRunner(builtin, settings)
        if not self.rows:
            raise ValueError("the dataset has no rows")
        self.per_round = max(1, d.concurrency // spec.loop.n_samples_per_prompt)
        self.loop, self.on_event = loop, on_event
        self.adapter_first = adapter is not None and spec.train  # episodes start once the job's adapter is served
        self.episodes = 0
        self.halt = threading.Event()  # set with the loop's stop, or alone when the job reaches its end

    def stop(self) -> None:
        """No new round; the round in flight makes no new call (join the thread that runs ``run``: it ends once
        the calls in flight are answered and recorded)."""
        self.halt.set()

    def run(self, passes: int | None = None) -> None:
        """Play rounds until the loop stops, or (``passes``) until every row was played that many times."""
        i = 0
        total = None if passes is None else passes * len(self.rows)
        stopping = _Either(self.loop.stop, self.halt)
        while not stopping.is_set() and (total is None or i < total):
            if self.loop.paused.is_set() or (self.adapter_first and not self.loop.published.is_set()):
                stopping.wait(0.2)  # paused, or its adapter not yet on the engines (the alias names nothing yet)
                continue
            n = self.per_round if total is None else min(self.per_round, total - i)
            chunk = [self.rows[(i + k) % len(self.rows)] for k in range(n)]
            try:
                summary = asyncio.run(self.runner.run(chunk, stop=stopping))
            except Exception as e:  # noqa: BLE001 - the server may be going down; retry unless stopping
                if stopping.is_set():
                    break
                log.warning("dataset episodes failed: %r", e)
                stopping.wait(1.0)
                continue
            if summary.cut:  # the job ended meanwhile: its in-flight turns were recorded, nothing more is sent
                break
            i += n
            self.episodes += summary.episodes
            self.on_event("episodes", {"episodes": summary.episodes, "total": self.episodes,
                                       "mean_reward": summary.mean_reward, "success_rate": summary.success_rate,
                                       "errors": summary.errors, "version": self.loop.state.version,
                                       **({"metrics": self.runner.metric_means}
                                          if getattr(self.runner, "metric_means", None) else {})})


class Evaluator:
    """Runs the job's eval sets in the background (one round at a time) and reports per version."""

    def __init__(self, specs: list[EvalSpec], base_url: str | None, api_key: str | None,
                 on_event: Callable[[str, dict[str, Any]], None], tb: Any,
                 job_stop: threading.Event | None = None, adapter: str | None = None) -> None:
        self.specs, self.base_url, self.api_key, self.on_event, self.tb = specs, base_url, api_key, on_event, tb
        self.adapter = adapter  # a LoRA job's alias: its policy is the adapter
        self._job_stop = job_stop or threading.Event()  # the job's loop stop: a cancel cuts the round at once
        self._lock = threading.Lock()
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pending: tuple[list[EvalSpec], int, int] | None = None  # the newest round that came due meanwhile
        self._cut = threading.Event()  # set by close: the round in progress stops where it is
        self._loaded: dict[str, Any] = {}  # eval set name -> its verifiers environment, loaded at its first round

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

    def finish(self) -> None:
        """The job reached its last step: let the round in progress and the one that came due meanwhile (the
        last step's) run and report, so they are in before the job is marked completed. Returns when no round
        is left, or once the job is stopped (a cancel: the round is cut)."""
        while not self._job_stop.is_set():
            with self._lock:
                thread = self._thread if self._running else None
            if thread is None:
                return
            thread.join(0.2)

    def close(self, timeout: float = 120.0) -> None:
        """No new rounds, none pending; the round in progress makes no new call and is not reported (its
        sessions must not outlive the job)."""
        with self._lock:
            self._closed, self._pending = True, None
            thread = self._thread
        self._cut.set()
        if thread is not None:
            thread.join(timeout)

    def _set(self, e: EvalSpec, settings: RunnerSettings) -> tuple[Sequence[Any], Any]:
        """An eval set's rows and the runner that plays them (a verifiers environment is loaded once per job)."""
        if e.source == "verifiers":
            from slime_server.agents.verifiers_runner import VerifiersRunner, load, rows_of  # lazy: verifiers

            env = self._loaded.get(e.name)
            if env is None:
                env = self._loaded[e.name] = load(e.environment, e.env_args)
            return rows_of(env, e.seed, e.num_prompts, split="eval"), VerifiersRunner(env, settings)
        env = get_environment(e.environment)
        rows = load_jsonl(e.dataset)[: e.num_prompts] if e.dataset else env.default_dataset(e.num_prompts, seed=e.seed)
        return rows, AgentRunner(env, settings)

    def _loop(self, specs: list[EvalSpec], step: int, version: int) -> None:
        job: tuple[list[EvalSpec], int, int] | None = (specs, step, version)
        while job is not None:
            self._run(*job)
            with self._lock:
                job, self._pending = (None if self._closed else self._pending), None
                if job is None:
                    self._running = False

    def _run(self, specs: list[EvalSpec], step: int, version: int) -> None:
        try:
            for e in specs:
                settings = RunnerSettings(
                    base_url=self.base_url or "", api_key=self.api_key or "none", n_samples_per_prompt=1,
                    concurrency=e.concurrency, temperature=e.temperature, max_tokens=e.max_tokens, seed=e.seed,
                    post_rewards=False, serve_only=True, adapter=self.adapter)
                try:
                    rows, runner = self._set(e, settings)
                except Exception as exc:  # noqa: BLE001 - an environment that does not load is this set's failure
                    self.on_event("eval_failed", {"name": e.name, "step": step, "error": repr(exc)[:500]})
                    continue
                try:
                    summary = asyncio.run(runner.run(rows, stop=_Either(self._job_stop, self._cut)))
                except Exception as exc:  # noqa: BLE001 - reported, never kills the job
                    self.on_event("eval_failed", {"name": e.name, "step": step, "error": repr(exc)[:500]})
                    continue
                if summary.cut:  # the job was cancelled or the server is stopping: a partial round is no score
                    return
                self.on_event("eval", {"name": e.name, "step": step, "version": version,
                                       "success_rate": summary.success_rate, "mean_reward": summary.mean_reward,
                                       "episodes": summary.episodes, "errors": summary.errors})
                if self.tb is not None:
                    self.tb.add_scalar(f"eval/{e.name}/success_rate", summary.success_rate, step)
                    self.tb.flush()
        except Exception as exc:  # noqa: BLE001 - an eval must never take the job down
            self.on_event("eval_failed", {"step": step, "error": repr(exc)[:500]})
