"""Partial rollouts and surplus aborts: the gateway side of slime's over-sampling machinery.

Partial rollouts. An engine may abort a generation that nobody asked to stop: a weight update
with ``/pause_generation {"mode": "abort"}``, an engine restart. The gateway then continues it:
it sends prompt + the tokens generated so far back through the router for the remaining
``max_new_tokens`` and splices the answers. The client sees one answer; the buffer records every
token with the logprob and the policy version that produced it, so a trajectory may span two
versions and the trainer's staleness and importance weights stay exact.

Surplus aborts. An environment or runner that over-sampled (more rollouts than the group needs)
calls ``POST /v1/sessions/{id}/abort``: every generation in flight for that session is aborted on
every engine (the router has no abort route; engines are found through its ``/workers`` list).
Those aborts are *ours*, so they are never continued; the turn is recorded with what was generated.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from slime_server.rollout.protocol import GenerateOutput, WeightVersionSpan, version_spans

log = logging.getLogger(__name__)


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
    """SGLang's ``weight_versions`` of the spliced answer: both parts' per-token versions, run-length
    encoded again (a run across the seam becomes one span)."""
    versions = (first.meta_info.token_versions(len(first.output_ids))
                + more.meta_info.token_versions(len(more.output_ids)))
    return version_spans(versions, str(more.meta_info.weight_version))


def splice(first: GenerateOutput, more: GenerateOutput) -> GenerateOutput:
    """``first`` followed by its continuation ``more`` (same prompt + first's tokens)."""
    a, b = first.meta_info, more.meta_info
    meta = a.model_copy(update={
        "finish_reason": b.finish_reason,
        "completion_tokens": a.completion_tokens + b.completion_tokens,
        "weight_version": b.weight_version,
        "output_token_logprobs": (a.output_token_logprobs or []) + (b.output_token_logprobs or [])
        if a.output_token_logprobs is not None or b.output_token_logprobs is not None else None,
        "output_top_logprobs": (a.output_top_logprobs or []) + (b.output_top_logprobs or [])
        if a.output_top_logprobs is not None or b.output_top_logprobs is not None else None,
        "weight_versions": _spans(first, more),
        "e2e_latency": (a.e2e_latency or 0.0) + (b.e2e_latency or 0.0) or None,
    })
    return GenerateOutput(text=first.text + more.text, output_ids=first.output_ids + more.output_ids,
                          meta_info=meta, index=first.index)


Generate = Callable[..., Awaitable[list[GenerateOutput]]]


def sample_rids(rid: str, n: int) -> list[str]:
    """The engine rids of a request's samples: ``rid`` itself, or SGLang's ``{rid}_{i}`` when n > 1."""
    return [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]


async def generate_continuing(generate: Generate, input_ids: list[int], sampling_params: dict[str, Any], *,
                              rid: str | None, aborted_by_us: Callable[[str], bool], max_continuations: int,
                              register: Callable[[str], None] | None = None,
                              **kw: Any) -> tuple[list[GenerateOutput], int]:
    """``generate`` and continue every output an engine aborted on its own; returns (outputs, continuations).

    A continuation's rid (``{sample rid}-cont{k}``) goes to ``register`` before it is sent, so a session
    abort that arrives meanwhile reaches it too; an abort of ``rid`` stops every further continuation."""
    outs = await generate(input_ids, sampling_params, rid=rid, **kw)
    budget = sampling_params.get("max_new_tokens")
    n = int(sampling_params.get("n", 1))
    bases = sample_rids(rid, n) if rid else [None] * n
    continued = 0
    result = []
    for i, out in enumerate(outs):
        attempt = 0
        while (_is_abort(out) and attempt < max_continuations and not (rid and aborted_by_us(rid))
               and (budget is None or len(out.output_ids) < budget)):
            params = {**sampling_params, "n": 1}
            if budget is not None:
                params["max_new_tokens"] = budget - len(out.output_ids)
            if params.get("sampling_seed") is not None:  # a fresh but reproducible stream for the rest
                params["sampling_seed"] = int(params["sampling_seed"]) + len(out.output_ids)
            base = bases[i] if i < len(bases) else None
            sub_rid = f"{base}-cont{attempt}" if base else None
            if sub_rid is not None and register is not None:
                register(sub_rid)
                if rid and aborted_by_us(rid):  # the abort came while we registered: do not send
                    break
            (more,) = (await generate(input_ids + out.output_ids, params, rid=sub_rid, **kw))[:1]
            out = splice(out, more)
            attempt += 1
            continued += 1
        result.append(out)
    return result, continued
