"""The training algorithm in one file (slime's ``train_async.py``, for live agent traffic).

    while the job runs:
        batch   = finished, rewarded, unconsumed trajectories from the buffer, whole groups only,
                  within ``max_staleness`` policy versions (stale ones dropped / down-weighted / kept)
        old     = trainer.compute_logprobs(batch)         # only for several steps or KL reward shaping
        samples = advantages(batch)                       # GRPO, REINFORCE++, ... (trainer/advantages.py)
        for mini in split(samples, num_steps_per_rollout):
            metrics = trainer.train_step(mini, old)       # Megatron-core ranks (Ray actors)
        buffer.mark_consumed(batch, step)
        version += 1
        every ``update_weights_interval`` steps: bucketed push of the new weights to every engine
        every ``checkpoint_interval`` steps:     checkpoint (model, optimizer, step, version)

Asynchronous by default: the gateway keeps serving (and recording with the old version) while a
step trains and while the weights stream in; the recorded per-token versions make the staleness of
every sample exact. ``sync=True`` pauses generation on the engines for the train + push window, so
rollout and training alternate (the baseline ``tools/bench_async.py`` compares against).

Off-policy correction: the loss multiplies each token by pi_old / pi_rollout (TIS, on the recorded rollout
log-probs; ``LossConfig.use_tis``, truncated or masked, per token or per sequence). Jobs turn it on by
default unless ``sync`` (``JobSpec.loss_config``): an asynchronous job trains on samples up to
``max_staleness`` versions old, and this weight is what makes their gradient the current policy's.
A KL term to a frozen reference (``loss.kl_coef``) is computed in the ranks, which then keep the base
weights beside the policy (``TrainerRankSettings.reference``).

Fault handling: a trainer rank that dies (kill -9, OOM) raises out of ``train_step``; ``recover``
rebuilds the ranks, reloads the last checkpoint, puts the data consumed after it back in the pool
(nothing acknowledged is lost) and pushes the restored weights under a NEW version number, so
versions only ever go up. An exception raised inside a live rank (a bad setting, a bug) is not a death:
the job fails at once with that message instead of restoring checkpoints to repeat it.
"""

from __future__ import annotations

import logging
import math
import queue
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, Field

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.buffer.store import DROPPED_STEP, TrajectoryStore
from slime_server.lora_format import ADAPTER_DIR
from slime_server.trainer.adapter_publish import AdapterPublication, AdapterPublisher
from slime_server.trainer.advantages import (
    compute_advantages,
    per_adapter,
    ppo_advantages,
)
from slime_server.trainer.checkpoint import checkpoint_dir
from slime_server.trainer.critic import explained_variance
from slime_server.trainer.engine_control import EngineControl
from slime_server.trainer.grammar_masks import GrammarMasker
from slime_server.trainer.samples import to_train_sample, with_opd
from slime_server.trainer.selection import Rejection, Selection, check_flat_streak, select, wait_reason
from slime_server.trainer.settings import Checkpoint, LoopSettings, LoopState
from slime_server.trainer.types import TrainSample
from slime_server.trainer.user_slots import UserSlots

log = logging.getLogger(__name__)
R = TypeVar("R")


class Trainer(Protocol):
    """What the loop needs from the trainer ranks (``TrainerGroup``, or one in-process ``TrainerRank``)."""

    def train_step(self, samples: Sequence[TrainSample], **kwargs: Any) -> dict[str, float]: ...

    def compute_logprobs(self, samples: Sequence[TrainSample], reference: bool = False) -> list[list[float]]: ...

    def compute_logprobs_and_routes(self, samples: Sequence[TrainSample]) -> tuple[list[list[float]],
                                                                                    list[RoutedExperts]]: ...

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]: ...

    def train_critic(self, samples: Sequence[TrainSample], old_values: Sequence[Sequence[float]]) -> dict[str, float]: ...

    def save_checkpoint(self, path: str) -> str: ...

    def load_checkpoint(self, path: str) -> dict[str, int]: ...

    def push_weights(self, engine_urls: Sequence[str], version: int | str,
                     bucket_bytes: int | None = None) -> dict[str, Any]: ...

    def push_adapter(self, engine_urls: Sequence[str], name: str, adapter: int | None = None) -> dict[str, Any]: ...

    def save_adapter(self, path: str, base_model: str | None = None, adapter: int | None = None,
                     with_adam: bool = False) -> str: ...

    def set_adapter(self, adapter: int, path: str | None = None) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


class Batch(BaseModel):
    """One step's data: the samples, each one's staleness in versions, and the store trajectories the step
    consumes (none for a file source: SFT conversations, a replayed export)."""

    samples: list[TrainSample]
    lags: list[int]
    consume: list[str] = Field(default_factory=list)
    rejected: list[str] = Field(default_factory=list)  # rejection sampling: trajectories the step leaves out


class BatchSource(Protocol):
    """Where a job's batches come from when not from the buffer (``trainer/sources.py``): batch ``step`` (0-based)
    is a pure function of the step, so a job restored from a checkpoint goes on with the batch after it."""

    def batch(self, step: int, version: int) -> Batch | None:
        """The batch of this step; None when the source is exhausted (the job is complete)."""


class TrainLoop:
    """One job's loop. ``run`` blocks until ``stop`` is set (or ``max_steps``); call it in a thread."""

    def __init__(self, store: TrajectoryStore, make_trainer: Callable[[], Trainer], engines: EngineControl,
                 settings: LoopSettings, checkpoint_dir: str | Path, *, state: LoopState | None = None,
                 on_step: Callable[[LoopState, dict[str, float]], None] | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None, job_id: str | None = None,
                 push_guard: Callable[[], AbstractContextManager[Any]] | None = None,
                 clock: Callable[[], float] = time.time, source: BatchSource | None = None,
                 supervised: bool = False, rejection: Rejection | None = None,
                 grammar_masker: GrammarMasker | None = None, adapter: AdapterPublication | None = None) -> None:
        self.store = store
        self.adapter = adapter  # a LoRA job publishing its adapter (None: pushes weights)
        self.state = state or LoopState()
        # lora.per 'user': each sample trains its user's adapter slot, each user's adapter is published apart
        self.users = None if adapter is None or not adapter.user_slots else UserSlots(
            self.state, adapter.user_slots, lambda sid: store.get_session(sid).owner, self._move_slot)
        self.publisher = None if adapter is None else AdapterPublisher(adapter, self.users,
                                                                        lambda k, d: self.on_event(k, d))
        # a per-user job's users trained since their last publication (None: all, as a start or a restore needs)
        self._unpublished: list[str] | None = None
        self.published = threading.Event()  # set once its adapter is on the engines (its episodes wait for it)
        self.grammar_masker = grammar_masker  # rebuilds constrained turns' masks (None: they stay out of the loss)
        self.source = source  # None: rewarded trajectories from the buffer
        self.supervised = supervised  # SFT: samples train as they are (no advantages, no old log-probs)
        self.rejection = rejection  # rejection sampling: only the buffer's samples that pass train
        self.exhausted = False
        self.clock = clock  # wall time, compared with the store's updated_at (group_timeout_s)
        self._waiting_at = float("-inf")  # when the wait reason was last worked out (it costs a query)
        self.job_id = job_id  # whose consumption this is (a restart releases only its own)
        self.make_trainer = make_trainer
        self.engines = engines
        self.settings = settings
        self.checkpoint_dir = Path(checkpoint_dir)
        self.on_step = on_step or (lambda state, metrics: None)
        self.on_event = on_event or (lambda kind, data: None)
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.checkpoint_requested = threading.Event()
        self.checkpoint_done = threading.Condition()
        self._between: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.trainer: Trainer | None = None
        self._last_step_end = time.monotonic()
        # held from a train step to its version bump and push: a catch-up push (sync_engine) never
        # interleaves with them, so the weights it sends always carry their own version number
        self._push_lock = threading.RLock()
        # entered around every window in which engines are paused for weights (a push, a catch-up push,
        # a sync-mode train step): whoever watches engine health (serve: EngineSupervisor.updating_weights)
        # must not take a paused engine for a dead one. Set by whoever builds the loop; nothing by default.
        self.push_guard: Callable[[], AbstractContextManager[Any]] = push_guard or nullcontext

    # ------------------------------------------------------------------ lifecycle
    def start_trainer(self) -> None:
        """Build the ranks; resume from the last checkpoint if there is one (and re-push its weights)."""
        t0 = time.monotonic()
        self.trainer = self.make_trainer()
        self._restore()
        self.on_event("trainer_ready", {"version": self.state.version, "step": self.state.step,
                                        "seconds": round(time.monotonic() - t0, 3),
                                        "warm": bool(getattr(self.trainer, "reused", False))})

    def _restore(self) -> None:
        assert self.trainer is not None
        ckpt = self.state.checkpoints[-1] if self.state.checkpoints else None
        if ckpt is None and self.state.step == 0 and self.adapter is not None:
            self._push()  # fresh adapter job: version 0 (B = 0: the base's answers) under the job's alias
            return
        if ckpt is None and self.state.step == 0:
            # fresh job: the engines serve the base weights as version 0, unless an earlier job moved
            # them on; then the base weights go out under the next version (versions never go back)
            served = [int(v) for v in self.engines.versions() if v is not None and v.lstrip("-").isdigit()]
            if any(v != self.state.version for v in served):
                self.state.version = max([*served, self.state.version]) + 1
                self._push()
            return
        if ckpt is not None:
            self.trainer.load_checkpoint(ckpt.path)
        for slot, origin in self.users.reseat(ckpt.step if ckpt else None) if self.users is not None else []:
            self.trainer.set_adapter(slot, origin)  # a slot that changed hands after the checkpoint
        released = self.store.release_consumed(ckpt.step if ckpt else 0, self.job_id)
        self.state.step = ckpt.step if ckpt else 0
        self.state.version += 1  # restored weights get a new version: versions never go back
        self._push()
        self.on_event("resumed", {"from_step": self.state.step, "version": self.state.version,
                                  "released_trajectories": released})

    def recover(self, error: BaseException) -> None:
        log.warning("trainer failed (%s); restarting from the last checkpoint", error)
        self.state.restarts += 1
        self.on_event("trainer_restart", {"error": repr(error)[:500], "restarts": self.state.restarts})
        if self.trainer is not None:
            try:
                self.trainer.shutdown()
            except Exception:  # noqa: BLE001 - the ranks are being replaced anyway
                pass
        self.trainer = None
        self.start_trainer()

    def run(self, *, max_restarts: int = 3) -> None:
        if self.trainer is None:
            self.start_trainer()
        failures = 0
        while not self.stop.is_set():
            if self.checkpoint_requested.is_set():
                self.checkpoint_requested.clear()
                self.checkpoint()
            while not self._between.empty():  # asked of the trainer by other threads (between_steps)
                fn, done = self._between.get()
                try:
                    done.set_result(fn())
                except Exception as e:  # noqa: BLE001 - the caller's to raise
                    done.set_exception(e)
            if self.exhausted or (self.settings.max_steps is not None and self.state.step >= self.settings.max_steps):
                return
            if self.paused.is_set():
                self.stop.wait(self.settings.poll_interval_s)
                continue
            try:
                metrics = self.step_once()
            except Exception as e:
                if not self._rank_died(e) or failures >= max_restarts:
                    raise
                failures += 1
                self.recover(e)
                continue
            if metrics is None:
                self.stop.wait(self.settings.poll_interval_s)

    def _rank_died(self, e: BaseException) -> bool:
        alive = getattr(self.trainer, "alive", None)
        return _is_trainer_failure(e, alive if callable(alive) else None)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.finish_unloads()
        if self.trainer is not None and self.publisher is not None and self.published.is_set():
            self.publisher.save(self.trainer, self.state.version)
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None

    # ------------------------------------------------------------------ one step
    def select_batch(self) -> Batch | None:
        """Whole groups, oldest first, until ``batch_size`` (rules: ``trainer/selection.py``); drops what
        must go, and says why it waits when the batch is not whole."""
        s = self.settings
        pool = self.store.list_heads(status="finished", rewarded=True, unconsumed=True,
                                     limit=max(4 * s.batch_size, 256))
        unowned: list[str] = []
        forgotten: list[str] = []
        if self.users is not None:  # per user: samples of no user (or forgotten) are dropped, beyond the slots wait
            trainable, no_user, gone = self.users.split(pool)
            pool, unowned, forgotten = trainable, [t.id for t in no_user], [t.id for t in gone]
        sel = select(pool, batch_size=s.batch_size, group_size=s.n_samples_per_prompt, version=self.state.version,
                     max_staleness=s.max_staleness, stale_policy=s.stale_policy,
                     drop_zero_variance=s.drop_zero_variance_groups, group_timeout_s=s.group_timeout_s,
                     now=self.clock(), lag_of=self.users.lag if self.users is not None else None)
        if unowned or forgotten:
            self.store.mark_consumed(unowned + forgotten, DROPPED_STEP, self.job_id)
            self.on_event("dropped", {"no_user": len(unowned), "forgotten_user": len(forgotten),
                                      "version": self.state.version})
        if sel.drop_stale or sel.drop_flat or sel.drop_incomplete:
            mark = lambda ids: self.store.mark_consumed(ids, DROPPED_STEP, self.job_id) if ids else 0  # noqa: E731
            stale, flat, incomplete = mark(sel.drop_stale), mark(sel.drop_flat), mark(sel.drop_incomplete)
            self.state.dropped_stale += stale
            self.state.dropped_zero_variance += flat
            self.state.dropped_incomplete += incomplete
            self.on_event("dropped", {"stale": stale, "zero_variance_or_empty": flat, "incomplete_groups": incomplete,
                                      "version": self.state.version})
        self.state.flat_groups_in_a_row = 0 if sel.complete(s.batch_size) else (self.state.flat_groups_in_a_row
                                                                                 + len(sel.flat_rewards))
        check_flat_streak(self.state.flat_groups_in_a_row, sel.flat_rewards, s.max_flat_groups_in_a_row)
        if not sel.complete(s.batch_size):
            self._note_waiting(sel)
            return None
        self.state.waiting = None
        chosen, lags = sel.chosen, sel.lags
        rejected: list[str] = []
        if self.rejection is not None:
            kept = set(self.rejection.keep_ids(chosen))
            rejected = [t.id for t in chosen if t.id not in kept]
            lags = [lag for t, lag in zip(chosen, lags, strict=True) if t.id in kept]
            chosen = [t for t in chosen if t.id in kept]
            if not chosen:  # no step: the whole batch is dropped (stored, never trained) now
                self._reject([], rejected)
                return None
        whole = self.store.get_trajectories_by_id([t.id for t in chosen])
        replay = self.settings.moe.routing_replay == "rollout"
        shown = self.store.get_images([s.sha256 for t in whole for s in t.images])  # {} without a read: no images
        samples = [to_train_sample(t, self.grammar_masker, routes=replay, images=shown) for t in whole]
        if self.users is not None:  # each through its user's adapter
            samples = self.users.assign(whole, samples)
            if self._unpublished is not None:
                self._unpublished = list(dict.fromkeys([*self._unpublished, *self.users.users_of(whole)]))
        return Batch(samples=samples, lags=lags, consume=[t.id for t in chosen], rejected=rejected)

    def _reject(self, kept: list[str], rejected: list[str]) -> None:
        """Rejection sampling's bookkeeping, once a batch's kept samples have trained (or none passed): the
        rejected ones are dropped then, not at selection, so a step that fails and is redone finds its
        groups whole and counts its samples once."""
        if rejected:
            self.store.mark_consumed(rejected, DROPPED_STEP, self.job_id)
        self.state.kept += len(kept)
        self.state.rejected += len(rejected)
        self.on_event("rejection", {"kept": len(kept), "rejected": len(rejected), "total_kept": self.state.kept,
                                    "total_rejected": self.state.rejected})

    def next_batch(self) -> Batch | None:
        """This step's batch: from the job's source (its step-th batch) or from the buffer."""
        if self.source is None:
            return self.select_batch()
        batch = self.source.batch(self.state.step, self.state.version)
        self.exhausted = batch is None
        return batch

    def _note_waiting(self, sel: Selection) -> None:
        """Work out why there is no batch (at most every 2 s: it reads the open sessions) and tell the job
        when the reason changes."""
        now = time.monotonic()
        if now - self._waiting_at < 2.0:
            return
        self._waiting_at = now
        s = self.settings
        open_rewarded = self.store.count_open_rewarded_sessions()
        reason = wait_reason(sel, batch_size=s.batch_size, group_size=s.n_samples_per_prompt,
                             open_rewarded_sessions=open_rewarded)
        if reason != self.state.waiting:
            self.state.waiting = reason
            self.on_event("waiting", {"reason": reason, "ready": len(sel.chosen),
                                      "incomplete_sessions": sel.incomplete_sessions,
                                      "open_rewarded_sessions": open_rewarded})

    def step_once(self) -> dict[str, float] | None:
        """Train on one batch if there is one; returns the step's metrics (None: not enough data yet)."""
        batch = self.next_batch()
        if batch is None:
            return None
        assert self.trainer is not None
        s = self.settings
        t0 = time.monotonic()
        raw = batch.samples
        old_lp: list[list[float]] | None = None
        kl: list[list[float]] | None = None
        routes = None  # R2: the routing of the policy before this batch's updates, replayed in its training forwards
        if not self.supervised and (s.num_steps_per_rollout > 1 or s.advantage.kl_coef > 0):
            if s.moe.routing_replay == "trainer":
                old_lp, routes = self.trainer.compute_logprobs_and_routes(raw)
            else:
                old_lp = self.trainer.compute_logprobs(raw)  # the policy before this batch's updates
        if not self.supervised and s.advantage.kl_coef > 0:  # REINFORCE++ reward shaping: k1 KL to the reference
            ref_lp = self.trainer.compute_logprobs(raw, reference=True)
            kl = [[o - r for o, r in zip(o_s, r_s, strict=True)] for o_s, r_s in zip(old_lp, ref_lp, strict=True)]
        values = self.trainer.compute_values(raw) if s.advantage.estimator == "gae" else None  # PPO's critic
        if routes is not None:  # after the reference's forward: it routes as its own routers choose
            raw = [x.model_copy(update={"routed_experts": r}) for x, r in zip(raw, routes, strict=True)]
        if self.supervised:  # SFT: the loss is the masked tokens' NLL; no advantages
            samples = list(raw)
        else:
            shaped = per_adapter(raw, lambda part, k, v: ppo_advantages(part, v, s.advantage, kl=k) if v is not None
                                 else compute_advantages(part, s.advantage, kl=k), kl=kl, values=values)
            samples = with_opd(shaped, s.opd)
        downweighted = 0
        if not self.supervised and s.stale_policy == "downweight" and s.max_staleness is not None:
            for i, lag in enumerate(batch.lags):
                if lag > s.max_staleness:
                    factor = s.stale_decay ** (lag - s.max_staleness)
                    samples[i] = samples[i].model_copy(update={"advantages": [a * factor for a in samples[i].advantages or []]})
                    downweighted += 1
        self.state.downweighted += downweighted
        # sync: the engines stay paused for the whole train step too, so the guard spans it
        with self.push_guard() if s.sync else nullcontext():
            if s.sync:
                self.engines.pause()
            try:
                with self._push_lock:
                    metrics = self._train(samples, old_lp if s.num_steps_per_rollout > 1 else None)
                    if values is not None:  # the critic steps on the policy's mini-batches, towards GAE returns
                        metrics.update(self._train_critic(samples, values))
                        metrics["explained_variance"] = explained_variance(
                            values, [x.returns or [] for x in samples], [x.loss_mask for x in samples])
                    if batch.consume:
                        self.store.mark_consumed(batch.consume, self.state.step + 1, self.job_id)
                    self.state.step += 1
                    if self.rejection is not None:
                        self._reject(batch.consume, batch.rejected)
                    self.state.version += 1
                    push: dict[str, Any] | None = None
                    if self.state.step % s.update_weights_interval == 0:
                        push = self._push()
            finally:
                if s.sync:
                    self.engines.resume()
        if self.state.step % s.checkpoint_interval == 0:
            self.checkpoint()
        now = time.monotonic()
        rewards = [x.reward for x in raw]
        tokens = sum(len(x.tokens) for x in raw)
        metrics.update(
            step=float(self.state.step), policy_version=float(self.state.version),
            reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            samples=float(len(samples)), tokens=float(tokens), trained_tokens=float(sum(x.num_loss_tokens for x in raw)),
            staleness_mean=statistics.fmean(batch.lags), staleness_max=float(max(batch.lags)),
            dropped_stale=float(self.state.dropped_stale), dropped_zero_variance=float(self.state.dropped_zero_variance),
            downweighted=float(self.state.downweighted), step_seconds=now - t0,
            tokens_per_s=tokens / max(now - self._last_step_end, 1e-9),
        )
        if self.rejection is not None:
            metrics.update(kept=float(self.state.kept), rejected=float(self.state.rejected))
        if push is not None:
            metrics.update(push_seconds=float(push.get("seconds", 0.0)), push_gbps=float(push.get("gbps", 0.0)))
        self._last_step_end = now
        self.on_step(self.state, {k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)})
        return metrics

    def _train(self, samples: list[TrainSample], old_lp: list[list[float]] | None) -> dict[str, float]:
        """``num_steps_per_rollout`` optimizer steps over consecutive mini-batches of ``samples``, each against
        ``old_lp`` (None: one step, whose old policy is the current one); metrics averaged over the steps."""
        import torch

        assert self.trainer is not None
        per_step = []
        for part in self._minibatches(len(samples)):
            old = None if old_lp is None else [torch.tensor(o, dtype=torch.float32) for o in old_lp[part]]
            per_step.append(dict(self.trainer.train_step(samples[part], old_logprobs=old, bump_version=False)))
        n = len(per_step)
        merged = _mean_metrics(per_step)
        merged.update({k: v for k, v in per_step[-1].items() if k in ("lr", "step", "policy_version")})
        for k in ("ratio_max", "tis_weight_max"):
            if k in merged:
                merged[k] = max(m[k] for m in per_step)
        if "ratio_min" in merged:
            merged["ratio_min"] = min(m["ratio_min"] for m in per_step)
        merged["optimizer_steps"] = float(n)
        return merged

    def _minibatches(self, n_samples: int) -> list[slice]:
        """The ``num_steps_per_rollout`` consecutive mini-batches a batch is trained in (slime's
        ``rollout_batch_size x n_samples = global_batch_size x num_steps_per_rollout``)."""
        n = self.settings.num_steps_per_rollout
        size = n_samples // n
        return [slice(i * size, (i + 1) * size) for i in range(n)]

    def _train_critic(self, samples: list[TrainSample], values: list[list[float]]) -> dict[str, float]:
        """One critic step per policy mini-batch, each clipped around the values the advantages were computed
        with (as slime trains its critic on the same global batches); metrics averaged over the steps."""
        assert self.trainer is not None
        per_step = [self.trainer.train_critic(samples[part], values[part])
                    for part in self._minibatches(len(samples))]
        merged = _mean_metrics(per_step)
        merged["critic_steps"] = float(len(per_step))
        return merged

    def _move_slot(self, slot: int, leaving: str | None, arriving: str | None) -> None:
        """A per-user job's slot changing hands: the leaving user's adapter published if a step trained it since,
        saved and parked (their alias keeps serving it, and comes back from the saved copy after a restart); the
        slot loaded with the arriving user's saved adapter, or a fresh one."""
        assert self.trainer is not None and self.publisher is not None and self.users is not None
        if leaving is not None:
            with self._push_lock:
                if leaving in (self._unpublished or []):
                    self.publisher.publish(self.trainer, self.engines.urls(), self.state.version, [leaving])
                    self._unpublished = [u for u in self._unpublished or [] if u != leaving]
            path = self.publisher.park(self.trainer, leaving, slot, self.state.version)
            self.users.park(leaving, path)
        self.trainer.set_adapter(slot, arriving)
        self.on_event("user_slot", {"slot": slot, "parked": leaving is not None, "restored": arriving is not None})

    def between_steps(self, fn: Callable[[], R], timeout: float) -> R:
        """``fn``'s result (or error) once the loop's thread (the trainer's owner) has run it before its next step;
        ``TimeoutError`` after ``timeout`` seconds."""
        done: Future[Any] = Future()
        self._between.put((fn, done))
        return done.result(timeout)

    def forget_user(self, alias: str) -> dict[str, Any]:
        """A per-user job forgets the user of adapter ``alias``, being deleted (on the loop's thread): their slot
        starts fresh, their parked copy and unconsumed samples go, and a checkpoint without them replaces every
        earlier one (those hold their tensors). Their next rewarded conversation seats them as a newcomer."""
        assert self.trainer is not None and self.users is not None
        user = self.users.by_alias(alias)
        if user is None:
            return {"forgotten": False}
        with self._push_lock:
            slot, parked = self.users.forget(user, time.time())
            if slot is not None:
                self.trainer.set_adapter(slot, None)
            self._unpublished = None if self._unpublished is None else [u for u in self._unpublished if u != user]
        heads = self.store.list_heads(status="finished", unconsumed=True, limit=1_000_000)
        theirs = [h.id for h in heads if self.users.user_of(h) == user]
        if theirs:
            self.store.mark_consumed(theirs, DROPPED_STEP, self.job_id)
        if parked:
            shutil.rmtree(parked, ignore_errors=True)
        before, ckpt = [Path(c.path) for c in self.state.checkpoints], self.checkpoint()
        with self.checkpoint_done:
            self.state.checkpoints = [ckpt]
        for path in (p for p in before if p != Path(ckpt.path)):
            shutil.rmtree(path, ignore_errors=True)
        data = {"alias": alias, "slot": slot, "dropped_samples": len(theirs), "checkpoints_removed": len(before)}
        self.on_event("user_forgotten", data)
        return {"forgotten": True, **data}

    def checkpoint(self) -> Checkpoint:
        assert self.trainer is not None

        path = self.trainer.save_checkpoint(str(checkpoint_dir(self.checkpoint_dir, self.state.step)))
        ckpt = Checkpoint(step=self.state.step, version=self.state.version, path=path)
        if self.publisher is not None and self.users is not None:  # each user's adapter as PEFT loads it
            self.publisher.save(self.trainer, ckpt.version, Path(path) / "users")
        elif self.adapter is not None:
            self.adapter.saved(self.adapter.alias, ckpt.version, str(Path(path) / ADAPTER_DIR))
        with self.checkpoint_done:  # complete, users' adapters included, before anyone waiting hears of it
            self.state.checkpoints.append(ckpt)
            self.checkpoint_done.notify_all()
        self.on_event("checkpoint", ckpt.model_dump())
        return ckpt

    def sync_engine(self, url: str) -> bool:
        """Bring one (restarted) engine to the current weights; False when there is no trainer yet."""
        with self._push_lock:
            if self.trainer is None:
                return False
            if self.publisher is not None:  # a restarted engine lacks the adapters; its base weights never moved
                stats = self.publisher.sync(self.trainer, url, self.state.version)
            else:
                with self.push_guard():
                    stats = self.trainer.push_weights([url], self.state.version, self.settings.bucket_bytes)
        self.on_event("engine_caught_up", {"url": url, "version": self.state.version, "seconds": stats.get("seconds")})
        return True

    def _push(self) -> dict[str, Any]:
        assert self.trainer is not None
        if self.adapter is not None:
            return self._publish()
        with self._push_lock:
            urls = self.engines.urls()
            with self.push_guard():
                stats = self.trainer.push_weights(urls, self.state.version, self.settings.bucket_bytes)
        self.on_event("weights_pushed", {"version": self.state.version, "engines": len(urls),
                                         "seconds": stats.get("seconds"), "bytes": stats.get("bytes"),
                                         "referenced_bytes": stats.get("referenced_bytes"),
                                         "mode": stats.get("mode")})
        return stats


    def _publish(self) -> dict[str, Any]:
        """The adapters' current version into every engine (nothing paused), each alias moved to it, the versions
        they left unloaded in the background (trainer/adapter_publish.py). A per-user job publishes the users trained
        since its last publication; a start or a restore, every user."""
        assert self.trainer is not None and self.publisher is not None
        with self._push_lock:
            users, self._unpublished = self._unpublished, []
            stats = self.publisher.publish(self.trainer, self.engines.urls(), self.state.version, users)
        self.published.set()
        return stats


def _is_trainer_failure(e: BaseException, alive: Callable[[], bool] | None = None) -> bool:
    """A rank that died (killed, OOM, crashed), as opposed to an error raised inside a live rank (a bad
    setting, a bug, bad data), which a restart would only repeat. An exception inside a rank arrives as
    ``RayTaskError``; when a peer died mid-collective the survivors raise one too, so it counts as a death
    only if some rank no longer answers (``alive``)."""
    try:
        import ray.exceptions as rex
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    if isinstance(e, rex.RayActorError | rex.ActorDiedError | rex.WorkerCrashedError):
        return True
    if isinstance(e, rex.RayTaskError):
        return alive is not None and not alive()
    return False


def _mean_metrics(per_step: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The numeric metrics every step reported, averaged over the steps."""
    return {k: statistics.fmean(m[k] for m in per_step) for k in per_step[0]
            if all(isinstance(m.get(k), int | float) for m in per_step)}
