"""Partial rollouts and surplus aborts: the gateway side of slime's over-sampling machinery.

Partial rollouts. An engine may abort a generation that nobody asked to stop: a weight update
with ``/pause_generation {"mode": "abort"}``, an engine restart. The gateway then continues it:
it sends prompt + the tokens generated so far back through the router for the remaining
``max_new_tokens`` and splices the answers. The client sees one answer; the buffer records every
token with the logprob and the policy version that produced it, so a trajectory may span two
versions and the trainer's staleness and importance weights stay exact.

Engine failures. An engine that dies (kill -9, OOM) or cannot be reached takes its generations
with it: the router answers 502/503, or the connection drops. Nothing of a non-streamed answer has
reached the client yet, so the gateway sends the generation again (a fresh rid, after a short
backoff) and the router routes it to a live engine; after a continuation, only the lost part is
generated again. A streamed answer goes on from the tokens the client already has, as after an
engine-side abort (``stream_samples``). ``engine_retries`` bounds it; a request the engine itself
refused (400) is never retried.

Surplus aborts. An environment or runner that over-sampled (more rollouts than the group needs)
calls ``POST /v1/sessions/{id}/abort``: every generation in flight for that session is aborted on
every engine (the router has no abort route; engines are found through its ``/workers`` list).
Those aborts are *ours*, so they are never continued; the turn is recorded with what was generated.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import Counter

from slime_server.gateway.engine_client import EngineError
from slime_server.gateway.token_text import join_texts
from slime_server.rollout.protocol import (
    FinishReason,
    GenerateOutput,
    MetaInfo,
    WeightVersionSpan,
    version_spans,
)

log = logging.getLogger(__name__)

ENGINE_RETRIES = Counter("slime_engine_retries_total", "generations sent again after their engine failed "
                         "(died, unreachable: 502/503 from the router)")
RETRY_BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # then 4 s per further try


class InflightRegistry:
    """Which engine request ids (rids) are running for which session, and which we aborted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_session: dict[str, set[str]] = {}
        self._aborted: set[str] = set()

    def add(self, session_id: str, rid: str) -> None:
        with self._lock:
            self._by_session.setdefault(session_id, set()).add(rid)

    def done(self, session_id: str, rid: str) -> None:
        with self._lock:
            rids = self._by_session.get(session_id)
            if rids is not None:
                rids.discard(rid)
                if not rids:
                    del self._by_session[session_id]
            self._aborted.discard(rid)

    def mark_aborted(self, session_id: str) -> list[str]:
        with self._lock:
            rids = sorted(self._by_session.get(session_id, ()))
            self._aborted.update(rids)
        return rids

    def aborted(self, rid: str) -> bool:
        with self._lock:
            return rid in self._aborted


async def abort_everywhere(router_url: str, rids: list[str], http: httpx.AsyncClient) -> int:
    """``/abort_request`` for each rid on every worker the router knows; returns engines reached."""
    r = await http.get(f"{router_url}/workers")
    r.raise_for_status()
    urls = [w["url"] for w in r.json().get("workers", [])]

    async def one(url: str) -> bool:
        try:
            for rid in rids:
                (await http.post(f"{url}/abort_request", json={"rid": rid})).raise_for_status()
            return True
        except httpx.HTTPError as e:
            log.warning("abort on %s failed: %r", url, e)
            return False

    return sum(await asyncio.gather(*(one(u) for u in urls)))


def _is_abort(out: GenerateOutput) -> bool:
    fr = out.meta_info.finish_reason
    return fr is not None and fr.type == "abort"


def _spans(first: GenerateOutput, more: GenerateOutput) -> list[WeightVersionSpan]:
    """SGLang's ``weight_versions`` of the spliced answer: ``first``'s spans, then ``more``'s shifted by
    ``len(first.output_ids)``, run-length encoded again (a run across the seam becomes one span)."""
    versions = (first.meta_info.token_versions(len(first.output_ids))
                + more.meta_info.token_versions(len(more.output_ids)))
    return version_spans(versions, str(more.meta_info.weight_version or first.meta_info.weight_version or ""))


def splice(first: GenerateOutput, more: GenerateOutput,
           token_bytes: Callable[[int], bytes] | None = None) -> GenerateOutput:
    """``first`` followed by its continuation ``more`` (same prompt + first's tokens); with ``token_bytes``
    a character split between the two (an abort between its tokens) is mended in the text."""
    a, b = first.meta_info, more.meta_info
    spans = _spans(first, more)
    meta = a.model_copy(update={
        "finish_reason": b.finish_reason,
        "completion_tokens": a.completion_tokens + b.completion_tokens,
        "weight_version": spans[-1].version,  # SGLang: the last span's version
        "output_token_logprobs": (a.output_token_logprobs or []) + (b.output_token_logprobs or [])
        if a.output_token_logprobs is not None or b.output_token_logprobs is not None else None,
        "output_top_logprobs": (a.output_top_logprobs or []) + (b.output_top_logprobs or [])
        if a.output_top_logprobs is not None or b.output_top_logprobs is not None else None,
        "weight_versions": spans,
        "e2e_latency": (a.e2e_latency or 0.0) + (b.e2e_latency or 0.0) or None,
        # the continuation was asked from the same start over prompt + first's tokens: its routes cover both
        "routed_experts": b.routed_experts,
    })
    text = (first.text + more.text if token_bytes is None else
            join_texts(first.text, first.output_ids, more.text, more.output_ids, token_bytes))
    return GenerateOutput(text=text, output_ids=first.output_ids + more.output_ids,
                          meta_info=meta, index=first.index)


Generate = Callable[..., Awaitable[list[GenerateOutput]]]
SEED_MODULUS = 2**63  # engines take a sampling_seed in [0, 2**63)
ABORT_RESEND_S = 1.0


def sample_rids(rid: str, n: int) -> list[str]:
    """The engine rids of a request's samples: ``rid`` itself, or ``{rid}_{i}`` when n > 1.

    With n > 1 every sample is an engine request of its own (n = 1, rid ``{rid}_{i}``, seed
    ``sampling_seed + i``): SGLang 0.5.23 gives the samples of one n > 1 request fresh uuids
    (``regenerate_rid``), which no abort by rid reaches."""
    return [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]


def _shift_seed(params: dict[str, Any], k: int) -> dict[str, Any]:
    if params.get("sampling_seed") is not None and k:
        params["sampling_seed"] = (int(params["sampling_seed"]) + k) % SEED_MODULUS
    return params


def constrained(params: dict[str, Any]) -> bool:
    """Whether a sample decodes under a grammar (SGLang's four fields). Such a sample is never continued from
    prompt + its tokens so far: the grammar would start again at the cut, so a non-streamed one is generated again
    from its prompt and a streamed one that the client has part of fails."""
    return any(params.get(k) for k in ("json_schema", "regex", "ebnf", "structural_tag"))


def _aborted_before_sending(rid: str, prompt_len: int) -> GenerateOutput:
    """What an engine answers for a request aborted in its queue: no token, finish ``abort``."""
    return GenerateOutput(text="", output_ids=[], meta_info=MetaInfo(
        id=rid, finish_reason=FinishReason(type="abort", message="aborted by the session before it was sent"),
        prompt_tokens=prompt_len, completion_tokens=0))


class _Retrying:
    """``generate`` for one sample, sending a call again when its engine failed (module docstring)."""

    def __init__(self, generate: Generate, rid: str | None, retries: int, aborted_by_us: Callable[[str], bool],
                 register: Callable[[str], None] | None) -> None:
        self.generate, self.rid, self.retries = generate, rid, retries
        self.aborted_by_us, self.register = aborted_by_us, register
        self.tries = 0  # retries used by this sample so far (all its calls share the budget)

    async def __call__(self, input_ids: list[int], params: dict[str, Any], call_rid: str | None,
                       kw: dict[str, Any]) -> GenerateOutput:
        while True:
            try:
                return (await self.generate(input_ids, params, rid=call_rid, **kw))[0]
            except EngineError as e:
                if (e.status not in (502, 503) or self.tries >= self.retries
                        or (self.rid is not None and self.aborted_by_us(self.rid))):
                    raise
                log.warning("engine call %s failed (%s); sending it again", call_rid, e)
                await asyncio.sleep(RETRY_BACKOFF_S[min(self.tries, len(RETRY_BACKOFF_S) - 1)])
                self.tries += 1
                ENGINE_RETRIES.inc()
                if call_rid is not None:  # a fresh rid: the failed one may still be known to a live engine
                    call_rid = f"{call_rid.split('-retry')[0]}-retry{self.tries}"
                    if self.register is not None:
                        self.register(call_rid)


async def generate_continuing(generate: Generate, input_ids: list[int], sampling_params: dict[str, Any], *,
                              rid: str | None, aborted_by_us: Callable[[str], bool], max_continuations: int,
                              register: Callable[[str], None] | None = None,
                              token_bytes: Callable[[int], bytes] | None = None, engine_retries: int = 0,
                              **kw: Any) -> tuple[list[GenerateOutput], int]:
    """``generate`` every sample and continue each output an engine aborted on its own; returns
    (outputs in sample order, continuations).

    Each engine rid goes to ``register`` before it is sent (the samples' ``sample_rids`` all at once,
    before anything is sent; a continuation's ``{sample rid}-cont{k}`` just before it is), so a session
    abort that arrives meanwhile reaches it; an abort of a sample's rid stops its further continuations."""
    n = int(sampling_params.get("n", 1))
    rids: list[str | None] = list(sample_rids(rid, n)) if rid else [None] * n
    if register is not None:
        for r in rids:
            if r is not None:
                register(r)
    if n == 1:
        out, continued = await _one_sample(_Retrying(generate, rids[0], engine_retries, aborted_by_us, register),
                                           input_ids, dict(sampling_params), rids[0], aborted_by_us,
                                           max_continuations, register, token_bytes, kw)
        return [out], continued
    tasks = [asyncio.ensure_future(_one_sample(
        _Retrying(generate, r, engine_retries, aborted_by_us, register), input_ids,
        _shift_seed({**sampling_params, "n": 1}, i), r, aborted_by_us, max_continuations,
        register, token_bytes, kw)) for i, r in enumerate(rids)]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException:  # one sample failed (or we were cancelled): stop the others
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        raise
    return [o for o, _ in done], sum(c for _, c in done)


async def _one_sample(generate: _Retrying, input_ids: list[int], params: dict[str, Any], rid: str | None,
                      aborted_by_us: Callable[[str], bool], max_continuations: int,
                      register: Callable[[str], None] | None, token_bytes: Callable[[int], bytes] | None,
                      kw: dict[str, Any]) -> tuple[GenerateOutput, int]:
    if rid is not None and aborted_by_us(rid):
        return _aborted_before_sending(rid, len(input_ids)), 0
    out = await generate(input_ids, params, rid, kw)
    budget = params.get("max_new_tokens")
    continued = 0
    while (_is_abort(out) and continued < max_continuations and not (rid and aborted_by_us(rid))
           and (budget is None or len(out.output_ids) < budget)):
        more_params = _shift_seed(dict(params), len(out.output_ids))  # a fresh but reproducible stream
        if budget is not None:
            more_params["max_new_tokens"] = budget - len(out.output_ids)
        sub_rid = f"{rid}-cont{continued}" if rid else None
        if sub_rid is not None and register is not None:
            register(sub_rid)
            if aborted_by_us(rid):  # the abort came while we registered: do not send
                break
        if constrained(params):  # its grammar would start again at the cut: generate the sample again instead
            out = await generate(input_ids, _shift_seed(dict(params), len(out.output_ids) + 1), sub_rid, kw)
        else:
            more = await generate(input_ids + out.output_ids, more_params, sub_rid, kw)
            out = splice(out, more, token_bytes)
        continued += 1
    return out, continued


def abort_resending(generate: Generate, aborted: Callable[[str], bool],
                    abort: Callable[[list[str]], Awaitable[Any]], interval: float = ABORT_RESEND_S) -> Generate:
    """``generate`` that, while a call whose rid we aborted is still running, sends that abort again every
    ``interval`` seconds: an abort that reached the engine before the request did stopped nothing (SGLang
    and our engine drop an abort for a rid they do not know)."""

    async def call(input_ids: list[int], params: dict[str, Any], *, rid: str | None = None,
                   **kw: Any) -> list[GenerateOutput]:
        task = asyncio.ensure_future(generate(input_ids, params, rid=rid, **kw))
        if rid is None:
            return await task
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=interval)
                if done:
                    return task.result()
                if aborted(rid):
                    try:
                        await abort([rid])
                    except Exception as e:  # best effort: the next round tries again
                        log.warning("abort of %s failed: %r", rid, e)
        finally:
            if not task.done():
                task.cancel()

    return call


StreamOne = Callable[..., AsyncIterator[GenerateOutput]]


async def stream_samples(stream: StreamOne, input_ids: list[int], params: dict[str, Any], rid: str, *,
                         aborted: Callable[[str], bool], abort: Callable[[list[str]], Awaitable[Any]],
                         register: Callable[[str], None] | None = None, max_continuations: int = 0,
                         engine_retries: int = 0, token_bytes: Callable[[int], bytes] | None = None,
                         on_continue: Callable[[str], None] | None = None, interval: float = ABORT_RESEND_S,
                         **kw: Any) -> AsyncIterator[GenerateOutput]:
    """A streamed request's samples as engine streams of their own, merged, continued as ``generate_continuing``
    continues a non-streamed one; events are cumulative (SGLang's: text and tokens so far), tagged with the
    sample's ``index`` when n > 1.

    - Every sample is one engine stream (n > 1: rid ``{rid}_{i}``, seed + i; ``sample_rids``); the caller
      registers ``sample_rids(rid, n)`` before iterating, and ``register`` gets every further rid before it is
      sent (``{sample rid}-cont{k}``, ``-retry{k}``), so a session abort reaches it.
    - An engine-side abort (weight update in ``abort`` mode, engine restart) is not shown: the sample goes on
      from prompt + its tokens so far (up to ``max_continuations`` times), and the client's stream carries on
      where it was, the spliced answer's tokens, logprobs and versions as one (``splice``).
    - An engine that fails mid-stream (died: 502/503, the connection dropped, a stream that ended without its
      final event) is the same: the sample goes on from the tokens the client has, on a live engine (up to
      ``engine_retries`` times); before its first token this is the plain resend of a non-streamed call.
    - A sample the session aborted is not sent or continued; while it still streams, its abort is sent again
      every ``interval`` seconds (an abort that reached the engine before the request stopped nothing).

    ``on_continue(kind)`` counts each "continuation" and "retry"."""
    n = int(params.get("n") or 1)
    rids = sample_rids(rid, n)
    current = list(rids)  # each sample's engine rid now streaming (the one an abort must reach)
    queue: asyncio.Queue[tuple[int, GenerateOutput | BaseException | None]] = asyncio.Queue()

    def next_rid(i: int, kind: str, k: int) -> str:
        current[i] = f"{rids[i]}-{kind}{k}"
        if register is not None:
            register(current[i])
        if on_continue is not None:
            on_continue("continuation" if kind == "cont" else "retry")
        return current[i]

    async def pump(i: int) -> None:
        r = rids[i]
        try:
            if aborted(r):
                await queue.put((i, _aborted_before_sending(r, len(input_ids))))
                return
            sample = _shift_seed({**params, "n": 1}, i) if n > 1 else dict(params)
            budget = sample.get("max_new_tokens")
            so_far: GenerateOutput | None = None  # what the client has of this sample (cumulative)
            continued = tries = 0
            while True:
                if so_far is None:
                    prompt, call = input_ids, sample
                elif constrained(sample):  # the client has part of it; its grammar cannot resume at the cut
                    raise EngineError(502, "the engine stopped a constrained generation part-way; it cannot be "
                                      "continued", code="engine_error")
                else:  # a fresh but reproducible stream for the rest, as generate_continuing's
                    prompt, call = input_ids + so_far.output_ids, _shift_seed(dict(sample), len(so_far.output_ids))
                    if budget is not None:
                        call["max_new_tokens"] = budget - len(so_far.output_ids)
                last: GenerateOutput | None = None
                failure: EngineError | None = None
                try:
                    async for out in stream(prompt, call, rid=current[i], **kw):
                        last = out if so_far is None else splice(so_far, out, token_bytes)
                        if not _is_abort(out):
                            await queue.put((i, last))
                except EngineError as e:
                    failure = e
                if failure is None and (last is None or last.meta_info.finish_reason is None):
                    failure = EngineError(502, "the engine stream ended before its final event",
                                          code="engine_error")
                if failure is not None:  # the engine failed: go on from what the client has
                    if failure.status not in (502, 503) or tries >= engine_retries or aborted(r):
                        raise failure
                    if last is not None and budget is not None and len(last.output_ids) >= budget:
                        # cut after its last token, before the final event: nothing is left to generate
                        done = FinishReason(type="length", length=budget)
                        await queue.put((i, last.model_copy(update={"meta_info": last.meta_info.model_copy(
                            update={"finish_reason": done})})))
                        return
                    log.warning("engine stream %s failed (%s); going on from %d tokens", current[i], failure,
                                len((last or so_far).output_ids) if (last or so_far) else 0)
                    so_far = last if last is not None else so_far
                    await asyncio.sleep(RETRY_BACKOFF_S[min(tries, len(RETRY_BACKOFF_S) - 1)])
                    tries += 1
                    next_rid(i, "retry", tries)
                    continue
                assert last is not None  # a stream without a final event is a failure (above)
                if not _is_abort(last):
                    return
                if (continued >= max_continuations or aborted(r)
                        or (budget is not None and len(last.output_ids) >= budget)):
                    await queue.put((i, last))  # ours, or out of continuations: the turn ends here
                    return
                so_far = last
                next_rid(i, "cont", continued)
                continued += 1
                if aborted(r):  # the abort came while we registered: do not send
                    await queue.put((i, so_far))
                    return
        except Exception as e:  # noqa: BLE001  (handed to the consumer, which raises it)
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(n)]
    running = set(range(n))
    loop = asyncio.get_running_loop()
    next_resend = loop.time() + interval
    try:
        while running:
            try:
                i, item = await asyncio.wait_for(queue.get(), timeout=interval)
            except TimeoutError:
                i, item = -1, None
            if loop.time() >= next_resend:
                again = [current[k] for k in running if aborted(rids[k])]
                if again:
                    try:
                        await abort(again)
                    except Exception as e:  # noqa: BLE001  (best effort: the next round tries again)
                        log.warning("abort of %s failed: %r", again, e)
                next_resend = loop.time() + interval
            if i < 0:
                continue
            if item is None:
                running.discard(i)
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item if n == 1 else item.model_copy(update={"index": i})
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
