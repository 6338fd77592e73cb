"""CPU inference engine: a Hugging Face causal LM driven by an iteration-level (continuous) batching
scheduler, with per-request KV caches and bucketed, atomic weight updates.

Design
- One scheduler thread owns the model. Callers (HTTP handlers, in-process users) only enqueue
  requests and receive results through a callback; nothing else touches the model.
- Every iteration: apply a pending weight commit, admit waiting requests (prefill each alone, which
  samples its first token), then run ONE decode step for every running request together. Requests
  therefore join and leave the batch between decode steps.
- KV cache: each request owns per-layer K/V buffers (lean_forward.py batches them for a decode step); a request
  gets the same tokens and log-probs as when run alone, up to float rounding (~1e-6). LoRA adapters
  (engine_adapters.py) mix in one batch, at most ``max_loras_per_batch`` kinds (the base counts as one).

Log-prob rule and sampling: ``rollout/sampling.py`` (SGLang's default sampler).

Stop tokens: as SGLang, an EOS / ``stop_token_ids`` match is appended to ``output_ids`` (and to
``output_token_logprobs``) and ``finish_reason.matched`` is its id; only the text drops it (unless
``no_stop_trim``). A stop string ends generation with ``matched`` = the string; its tokens stay in
``output_ids`` and the text is cut before it. ``ignore_eos`` disables both EOS and ``stop_token_ids``
(SGLang checks them together); the length limit wins when both apply on the same token.

Weight updates (SGLang's semantics): each update request's tensors are copied into the live parameters
by the scheduler thread between two decode steps, so one request's tensors switch atomically; a
``weight_version`` given with it becomes the engine's version after the copy. A multi-bucket update is
consistent only while generation is paused, which is how the trainer drives it (``/pause_generation``
with ``retract``: running requests go back to the queue without their KV and are recomputed on the new
weights after ``/continue_generation``; ``in_place`` keeps their KV; ``abort`` ends them). The version
of every output token is recorded and reported as SGLang's ``weight_versions`` spans.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from slime_server.rollout import engine_routes
from slime_server.rollout.core_follow import ThreadsFollowCores
from slime_server.rollout.engine_adapters import EngineAdapters
from slime_server.rollout.engine_config import EngineConfig
from slime_server.rollout.engine_model import load_engine_model
from slime_server.rollout.engine_output import input_logprobs, output_of
from slime_server.rollout.engine_sequence import KV_INITIAL_HEADROOM, Sequence
from slime_server.rollout.engine_tasks import SchedulerTask, WeightCommit
from slime_server.rollout.engine_vision import EngineVision, ImageError, PromptImages, positions_of
from slime_server.rollout.grammar import EngineGrammars, GrammarError
from slime_server.rollout.hf_forward import hf_decode, hf_prefill
from slime_server.rollout.lean_forward import LeanForward
from slime_server.rollout.prefix_cache import NO_REUSE, Donor, PrefixCache
from slime_server.rollout.protocol import FinishReason, GenerateOutput, SamplingParams
from slime_server.rollout.sampling import sample_token
from slime_server.utils.procs import name_os_thread

log = logging.getLogger(__name__)
T = TypeVar("T")
SCHEDULER_OS_NAME = "slime-engine"  # the scheduler thread's OS name (top -H, /proc/<pid>/task/*/comm)


class BadRequest(ValueError):
    """Input the engine refuses (the server maps it to HTTP 400)."""


class FlushRefused(RuntimeError):
    """Weights were loaded but ``flush_cache`` was refused: requests were running or queued (SGLang
    0.5.23 then fails the update call and keeps the old ``weight_version``)."""


class CPUEngine:
    """Owns the model and the scheduler thread; thread-safe entry points for everything else."""

    def __init__(self, config: EngineConfig) -> None:
        """Loads the model on the scheduler thread (see ``_setup``) and returns once it serves; a loading error
        is raised here."""
        self.config = config
        self.weight_version: str = config.weight_version
        self._rng = random.Random(config.seed)
        self._cv = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._paused = False
        self._commit: WeightCommit | None = None
        self._tasks: deque[SchedulerTask] = deque()  # work handed to the scheduler thread (run_on_scheduler)
        self.adapters: EngineAdapters | None = None  # LoRA adapters (--enable-lora)
        self._update_lock = threading.Lock()  # one weight update at a time, in arrival order
        self._pause_req: tuple[str, threading.Event] | None = None
        self.last_progress = 0.0  # monotonic time of the last prefill or decode step (health probes)
        self._stop = False
        self.stats = {"prefill_tokens": 0, "decode_steps": 0, "generated_tokens": 0, "finished": 0}
        ready = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(ready, failed), name="cpu-engine-scheduler",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def _run(self, ready: threading.Event, failed: list[BaseException]) -> None:
        name_os_thread(SCHEDULER_OS_NAME)  # its OpenMP workers inherit the name
        try:
            self._setup()
        except BaseException as e:  # raised by __init__ in the caller's thread
            failed.append(e)
            return
        finally:
            ready.set()
        self._loop()

    def _setup(self) -> None:
        """Everything that computes with torch runs on this one thread, loading included. Why: torch's
        parallel ops use OpenMP, and every thread that runs one keeps a team of OpenMP workers for good; once
        the process holds more of them than it has cores, libgomp stops spinning between parallel regions
        and each of the ~500 ops of a decode step waits for its workers to wake (bf16 SmolLM2 at 2 threads:
        31 tok/s when the model had been loaded on another thread, 52 when not)."""
        from transformers import AutoTokenizer

        config = self.config
        self.threads = ThreadsFollowCores(config.num_threads)
        loaded = load_engine_model(config.model_path, getattr(torch, config.dtype), lean=config.forward == "lean")
        self.model = loaded.hf_model  # HF's model only where the lean forward does not serve (forward: hf)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        mc = loaded.config
        self.vocab_size: int = int(mc.vocab_size)
        self.context_length: int = config.context_length or int(getattr(mc, "max_position_embeddings", 4096))
        self.max_total_tokens: int = config.max_total_tokens or self.context_length * config.max_running_requests
        self.eos_ids: set[int] = set(loaded.eos_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        self._params: dict[str, torch.Tensor] = loaded.params
        self.vision = (EngineVision(config.model_path, loaded.vl_config, self._params, getattr(torch, config.dtype))
                       if loaded.vl_config is not None else None)  # images (engine_vision.py)
        self.lean = (LeanForward(mc, self._params, loaded.rope, decode_kernel=config.decode_kernel)
                     if loaded.rope is not None else None)
        self.weight_bytes = loaded.weight_bytes
        engine_routes.check_servable(config.enable_return_routed_experts, self.lean)
        self.kernel_target = self.lean.gemv_target if self.lean else None
        log.info("decode matmuls: %s", f"gemv.c built for {self.kernel_target}" if self.kernel_target else "torch")
        budget = int(config.prefix_cache_mb * 2**20 / self.lean.kv_bytes_per_token) if self.lean else 0
        self.prefix_cache = PrefixCache(budget) if budget > 0 else None
        if config.enable_lora or config.lora_paths:
            self._setup_lora()
        self.grammars = EngineGrammars(config.grammar_backend == "xgrammar", self.tokenizer, self.vocab_size,
                                       sorted(self.eos_ids), any_whitespace=not config.constrained_json_disable_any_whitespace,
                                       max_whitespace_cnt=config.constrained_json_max_whitespace_cnt)

    def _setup_lora(self) -> None:
        """The adapters (engine_adapters.py; on this thread, so the start's loads run inline)."""
        if self.lean is None:
            raise ValueError("LoRA serving needs the lean forward (--forward lean, a llama/mistral/qwen2/qwen3 model)")
        self.adapters = EngineAdapters(self.config, self.lean, self.run_on_scheduler, self._requests_using)

    def run_on_scheduler(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between two steps (it owns the model); its result or its error."""
        if threading.current_thread() is self._thread:
            return fn()
        task = SchedulerTask(fn)
        with self._cv:
            self._tasks.append(task)
            self._cv.notify_all()
        task.done.wait()
        if task.error is not None:
            raise task.error
        return task.result

    def _requests_using(self, adapter: object) -> int:
        with self._cv:
            return sum(1 for s in itertools.chain(self._waiting, self._running) if s.lora is adapter and s.finish is None)

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: list[int], params: SamplingParams, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1) -> None:
        """Raise BadRequest with a clear message for anything the engine cannot serve."""
        if not prompt_ids:
            raise BadRequest("input_ids must not be empty")
        if params.max_new_tokens is None:
            params = self.resolve(prompt_ids, params)
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.context_length:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"= {total} exceeds the context length {self.context_length}")
        if total > self.max_total_tokens:
            raise BadRequest(f"request needs {total} KV tokens, more than max_total_tokens {self.max_total_tokens}")
        if not 0 <= top_logprobs_num <= min(100, self.vocab_size):
            raise BadRequest(f"top_logprobs_num must be in [0, {min(100, self.vocab_size)}]")
        if logprob_start_len >= len(prompt_ids):
            raise BadRequest(f"logprob_start_len {logprob_start_len} must be < prompt length {len(prompt_ids)}")

    def prepare_images(self, prompt_ids: list[int], image_data: list[str]) -> tuple[list[int], PromptImages]:
        """A prompt's ids with each image's pad expanded, and its images (engine_vision.py); BadRequest when the
        model takes no images or an image or its placeholder is refused."""
        if self.vision is None:
            raise BadRequest(f"{Path(self.config.model_path).name} is a text-only model: it takes no image_data")
        try:
            return self.vision.prepare(prompt_ids, image_data)
        except ImageError as e:
            raise BadRequest(str(e)) from None

    def resolve(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Fill what the request left to the engine: ``max_new_tokens: null`` means the rest of the context."""
        if params.max_new_tokens is not None:
            return params
        room = max(self.context_length - len(prompt_ids), 0)
        return params.model_copy(update={"max_new_tokens": room})

    def attach_grammars(self, seqs: list[Sequence]) -> None:
        """Give each sequence with a grammar its matcher (``EngineGrammars.attach``: slow for a new schema, call it
        off the event loop before ``submit``); a grammar the engine cannot honour is a BadRequest naming it."""
        try:
            self.grammars.attach(seqs)
        except GrammarError as e:
            raise BadRequest(str(e)) from None

    def submit(self, seq: Sequence) -> Sequence:
        """Queue a validated sequence; ``seq.on_update`` fires (scheduler thread) per token if streaming
        and once at the end; ``seq.done`` is set when it finishes."""
        self.validate(seq.prompt_ids, seq.params, seq.top_logprobs_num, seq.logprob_start_len)
        self.attach_grammars([seq])  # a no-op when attached beforehand
        if seq.generator is None:
            seed = seq.params.sampling_seed if seq.params.sampling_seed is not None else self._rng.getrandbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
        with self._cv:  # an adapter unloaded since the request resolved it: its slot may be another's by now
            if seq.lora is not None and (self.adapters is None or self.adapters.bank.get(seq.lora.name) is not seq.lora):
                raise BadRequest(f"LoRA adapter {seq.lora.name} was unloaded before the request started")
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq

    def new_sequences(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                      **kw) -> list[Sequence]:
        """The ``n`` sequences of one prompt; sample i uses seed ``sampling_seed + i`` when one is given.

        Rids as SGLang 0.5.23 gives them: ``rid`` (or a fresh uuid) for n == 1; for n > 1 every sample gets
        a fresh uuid hex (its tokenizer manager calls ``regenerate_rid`` per sample), so neither ``rid`` nor
        ``{rid}_{i}`` names a running sample and an abort by them stops nothing (only ``abort_all`` does).
        Callers that must abort samples one by one send n requests of n = 1 with rids of their own."""
        params = self.resolve(prompt_ids, params)
        out = []
        for i in range(params.n):
            p = params if params.sampling_seed is None else params.model_copy(
                update={"sampling_seed": (params.sampling_seed + i + 2**63) % 2**64 - 2**63})
            name = (rid or uuid.uuid4().hex) if params.n == 1 else uuid.uuid4().hex
            out.append(Sequence(rid=name, prompt_ids=list(prompt_ids), params=p, **kw))
        return out

    def rids_in_flight(self, rids: list[str]) -> list[str]:
        """Those of ``rids`` that name a request still queued or running."""
        wanted = set(rids)
        if not wanted:
            return []
        with self._cv:
            return sorted({s.rid for s in itertools.chain(self._waiting, self._running)
                           if s.finish is None and s.rid in wanted})

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, timeout: float = 600,
                 **kw) -> list[GenerateOutput]:
        """Blocking in-process generation (``n`` results)."""
        seqs = self.new_sequences(prompt_ids, params or SamplingParams(), **kw)
        self.attach_grammars(seqs)
        for s in seqs:
            self.submit(s)
        for s in seqs:
            if not s.done.wait(timeout):
                raise TimeoutError(f"request {s.rid} did not finish in {timeout}s")
        return [self.result(s) for s in seqs]

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort the request with this rid (exactly, as SGLang), or all; returns how many."""
        count = 0
        with self._cv:
            for s in itertools.chain(self._waiting, self._running):
                if abort_all or s.rid == rid:
                    s.abort_requested = True
                    count += 1
            self._cv.notify_all()
        return count

    def cancel(self, seqs: list[Sequence]) -> None:
        """Abort exactly these sequences (e.g. their HTTP client went away)."""
        with self._cv:
            for s in seqs:
                if s.finish is None:
                    s.abort_requested = True
            self._cv.notify_all()

    def pause(self, mode: str = "abort") -> None:
        """SGLang's pause modes: ``abort`` ends every request, ``retract`` puts running requests back in
        the queue without their KV (recomputed on resume), ``in_place`` freezes them as they are."""
        if mode == "abort":
            self.abort(abort_all=True)
        done = threading.Event()
        with self._cv:  # applied by the scheduler thread between two steps (a step may be running now)
            self._pause_req = (mode, done)
            self._cv.notify_all()
        done.wait(600)

    def _apply_pause(self) -> None:
        assert self._pause_req is not None
        mode, done = self._pause_req
        self._paused = True
        if mode == "retract":
            for s in reversed(self._running):
                if s.finish is None:
                    s.kv, s.kv_len = [], 0
                    self._waiting.appendleft(s)
            self._running = []
        self._pause_req = None
        done.set()

    def flush_cache(self) -> bool:
        """SGLang's rule: flushing needs an idle engine (waiting requests are ignored while paused)."""
        with self._cv:
            idle = not self._running and (self._paused or not self._waiting)
            if idle and self.prefix_cache is not None:
                self.prefix_cache.clear()
            return idle

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, int]:
        # a request finished in this step stays in _running until the scheduler takes the lock again: not counted
        with self._cv:
            return {"num_running_reqs": sum(1 for s in self._running if s.finish is None),
                    "num_waiting_reqs": len(self._waiting)}

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ weights
    def check_loadable(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every tensor must name a model tensor with the same shape (dtype may differ if both float)."""
        for name, t in named:
            p = self._params.get(name)
            if p is None:
                raise BadRequest(f"unknown parameter {name!r}")
            if tuple(p.shape) != tuple(t.shape):
                raise BadRequest(f"{name}: shape {list(t.shape)} != model shape {list(p.shape)}")
            if not (t.dtype.is_floating_point and p.dtype.is_floating_point) and t.dtype != p.dtype:
                raise BadRequest(f"{name}: dtype {t.dtype} cannot be loaded into {p.dtype}")

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: str | int | None,
                     flush: bool = False, timeout: float = 600) -> int:
        """Copy ``named`` into the live parameters between two decode steps (all or nothing), then take
        ``version`` if given; returns the number of tensors loaded. Raises BadRequest before touching
        anything when a tensor does not fit the model, FlushRefused (after loading, version unchanged)
        when ``flush`` is asked while requests run or wait unpaused."""
        self.check_loadable(named)
        commit = WeightCommit(named=named, version=None if version is None else str(version), flush=flush)
        with self._update_lock:
            with self._cv:
                self._commit = commit
                self._cv.notify_all()
            if not commit.done.wait(timeout):
                raise TimeoutError("the weight update did not run in time")
        if commit.error is not None:
            raise commit.error
        return len(named)

    def load_weights_from_disk(self, model_path: str, version: str | None, flush: bool = False) -> int:
        """Load a HF checkpoint's tensors (safetensors) through the same path."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise BadRequest(f"no *.safetensors files in {model_path!r}")
        named: dict[str, torch.Tensor] = {}
        for f in files:
            named.update(load_file(str(f)))
        return self.load_weights(list(named.items()), version, flush=flush)

    def _apply_commit(self) -> None:
        commit = self._commit
        assert commit is not None
        try:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # K/V of the old weights
            if self.vision is not None:
                self.vision.clear()  # and the vision tower's outputs
            with torch.no_grad():
                for name, t in commit.named:
                    self._params[name].copy_(t)
            if commit.flush and not (not self._running and (self._paused or not self._waiting)):
                commit.error = FlushRefused("requests are running or queued")
            elif commit.version is not None:
                self.weight_version = commit.version
        except BaseException as e:  # report to the caller; keep serving
            commit.error = e
        finally:
            self._commit = None
            commit.done.set()

    # ------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._stop and self._commit is None and self._pause_req is None and not self._tasks
                       and not self._has_work()):
                    self._cv.wait()
                if self._stop:
                    break
                while self._tasks:
                    self._tasks.popleft().run()
                if self._commit is not None:
                    self._apply_commit()
                    self._cv.notify_all()
                if self._pause_req is not None:
                    self._apply_pause()
                self._reap_aborted()
                admitted = self._admit()
                running = list(self._running) if not self._paused else []
            try:
                self.threads.follow()
                with torch.inference_mode():
                    donor = None  # prompts in lexicographic order: each may reuse the one before (Donor)
                    for seq in sorted(admitted, key=_prefix_key) if self.prefix_cache is not None else admitted:
                        donor = self._prefill(seq, donor)
                    running = [s for s in running if s.finish is None]
                    if running:
                        self._decode(running)
            except Exception as e:  # never kill the scheduler: fail the requests involved
                log.exception("engine step failed")
                for s in admitted + running:
                    if s.finish is None:
                        self._finish(s, FinishReason(type="abort", message=f"engine error: {e}"))
            with self._cv:
                self._running = [s for s in self._running if s.finish is None]

    def _has_work(self) -> bool:
        if any(s.abort_requested for s in itertools.chain(self._waiting, self._running)):
            return True
        return not self._paused and bool(self._waiting or self._running)

    def _reap_aborted(self) -> None:
        for s in [s for s in itertools.chain(self._waiting, self._running) if s.abort_requested]:
            if s.finish is None:
                self._finish(s, FinishReason(type="abort", message="aborted by request"))
        self._waiting = deque(s for s in self._waiting if s.finish is None)
        self._running = [s for s in self._running if s.finish is None]

    def _admit(self) -> list[Sequence]:
        if self._paused:
            return []
        used = sum(s.reserved_tokens for s in self._running)
        kinds = {s.lora_slot for s in self._running}  # adapters in the batch, the base counting as one (SGLang's)
        admitted = []
        while self._waiting and len(self._running) < self.config.max_running_requests:
            s = self._waiting[0]
            if self._running and used + s.reserved_tokens > self.max_total_tokens:
                break
            if s.lora_slot not in kinds and len(kinds) >= self.config.max_loras_per_batch:
                break
            kinds.add(s.lora_slot)
            self._waiting.popleft()
            self._running.append(s)
            admitted.append(s)
            used += s.reserved_tokens
        return admitted

    def _prefill(self, seq: Sequence, donor: Donor | None = None) -> Donor | None:
        """Compute ``seq``'s prompt K/V (reusing the prefix cache's or ``donor``'s) and sample its first token;
        returns what the next prompt may reuse from it."""
        resumed = bool(seq.output_ids)  # retracted by a pause: recompute its KV, sample nothing here
        ids = seq.prompt_ids + seq.output_ids[:-1]
        want_input = seq.return_logprob and seq.logprob_start_len >= 0 and not resumed
        n_prompt = len(ids)
        cap = max(n_prompt, min(seq.reserved_tokens, n_prompt + KV_INITIAL_HEADROOM))  # grows by doubling
        if self.lean is not None:
            seq.kv = self.lean.new_kv(cap)
            reused, start, routes = (self.prefix_cache.match(seq.cache_key()[:n_prompt], _namespace(seq), donor)
                                     if self.prefix_cache is not None and not want_input else NO_REUSE)
            for (kb, vb), (ck, cv) in zip(seq.kv, reused or [], strict=False):
                kb[:, :start], vb[:, :start] = ck[:, :start], cv[:, :start]
            seq.cached_tokens = start
            mm = seq.images
            logits = self.lean.prefill(ids, seq.kv, all_logits=want_input, start=start, lora_slot=seq.lora_slot,
                                       images=self.vision.embeddings(mm, start, len(seq.prompt_ids)) if mm else None,
                                       positions=positions_of(mm, n_prompt) if mm else None).float()
            engine_routes.after_prefill(seq, routes, start, self.lean.last_routes)
        else:
            seq.kv, logits = hf_prefill(self.model, ids, cap, want_input)
            logits = logits.float()
        seq.kv_len = n_prompt
        self.stats["prefill_tokens"] += n_prompt
        self.last_progress = time.monotonic()
        lent = (Donor([_namespace(seq), *seq.cache_key()[:n_prompt]], seq.kv, engine_routes.held(seq))
                if self.prefix_cache is not None and self.lean is not None else None)  # before a finish drops kv
        if not resumed:
            self._first_token(seq, logits, want_input)
        return lent

    def _first_token(self, seq: Sequence, logits: torch.Tensor, want_input: bool) -> None:
        if want_input:
            input_logprobs(seq, logits)
        if seq.params.max_new_tokens == 0:
            self._finish(seq, FinishReason(type="length", length=0))
            return
        last = logits[-1:]
        self.grammars.mask(last, [seq.grammar])
        self._sample_and_append(seq, last[0])

    def _decode(self, batch: list[Sequence]) -> None:
        logits = (self.lean.decode(batch) if self.lean is not None else hf_decode(self.model, batch)).float()
        engine_routes.after_decode(batch, self.lean)
        self.grammars.mask(logits, [s.grammar for s in batch])  # only the constrained rows change
        self.stats["decode_steps"] += 1
        self.last_progress = time.monotonic()
        for b, s in enumerate(batch):
            self._sample_and_append(s, logits[b])

    def _sample_and_append(self, seq: Sequence, logits: torch.Tensor) -> None:
        token, lp, top = sample_token(logits, seq.params, seq.generator, seq.top_logprobs_num)
        if seq.grammar is not None and not seq.grammar.accept_token(token):  # SGLang aborts it the same way
            self._finish(seq, FinishReason(type="abort", message=f"Grammar accept_token failed: token {token}"))
            return
        seq.output_ids.append(token)
        seq.output_logprobs.append(lp)
        if top is not None:
            seq.output_top.append(top)
        seq.output_versions.append(self.weight_version)
        self.stats["generated_tokens"] += 1
        reason = self._check_finished(seq)
        if reason is not None:
            self._finish(seq, reason)
        elif seq.stream and seq.on_update is not None:
            seq.on_update(seq)

    def _check_finished(self, seq: Sequence) -> FinishReason | None:
        p, tok = seq.params, seq.output_ids[-1]
        if len(seq.output_ids) >= p.max_new_tokens:
            return FinishReason(type="length", length=p.max_new_tokens)
        if not p.ignore_eos and (tok in self.eos_ids or tok in p.stop_token_ids):
            return FinishReason(type="stop", matched=tok)
        if seq.grammar is not None and seq.grammar.is_terminated():  # SGLang: FINISH_MATCHED_TOKEN
            return FinishReason(type="stop", matched=tok)
        if p.stop:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s and s in text:
                    return FinishReason(type="stop", matched=s)
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish = reason
        seq.finished_at = time.perf_counter()
        if self.prefix_cache is not None and reason.type != "abort" and seq.kv:  # scheduler thread only
            self.prefix_cache.put(seq.cache_key()[:seq.kv_len], seq.kv, _namespace(seq),
                                  engine_routes.held(seq))
        seq.kv = []
        self.stats["finished"] += 1
        if seq.on_update is not None:
            seq.on_update(seq)
        seq.done.set()

    # ------------------------------------------------------------------ results
    def result(self, seq: Sequence) -> GenerateOutput:
        """SGLang-shaped output of ``seq`` so far (``engine_output.output_of``)."""
        return output_of(seq, self.tokenizer, self.weight_version)


def _prefix_key(seq: Sequence) -> list[int]:
    """What orders a step's prompts so that each shares the most with the one before it (prefix_cache.Donor)."""
    return [_namespace(seq), *seq.cache_key()]


def _namespace(seq: Sequence) -> int:
    """What a sequence's K/V depends on beside its tokens: its adapter's load (0: the base)."""
    return seq.lora.uid if seq.lora is not None else 0
