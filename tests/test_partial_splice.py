"""The gateway's partial-rollout machinery without a stack (``gateway/partial.py``): spliced answers carry
SGLang's ``weight_versions`` spans shifted for the continuation, n > 1 runs as one engine request per
sample, every engine rid is registered before it is sent, and an abort is sent again while its request
still runs (the first one may have reached the engine before the request did)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from slime_server.gateway import partial
from slime_server.gateway.engine_client import EngineError
from slime_server.gateway.partial import abort_resending, generate_continuing, splice
from slime_server.rollout.protocol import FinishReason, GenerateOutput, MetaInfo, WeightVersionSpan

PROMPT = [11, 12, 13]


def _out(ids: list[int], spans: list[tuple[str, int, int]], finish: str, rid: str = "x") -> GenerateOutput:
    mi = MetaInfo(id=rid, finish_reason=FinishReason(type=finish), prompt_tokens=len(PROMPT),
                  completion_tokens=len(ids), weight_version=spans[-1][0],
                  weight_versions=[WeightVersionSpan(version=v, start=s, end=e) for v, s, e in spans],
                  output_token_logprobs=[(-0.5, t, None) for t in ids])
    return GenerateOutput(text="t" * len(ids), output_ids=ids, meta_info=mi)


def _spans(out: GenerateOutput) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in out.meta_info.weight_versions or []]


def test_splice_shifts_the_continuation_spans_and_merges_the_seam() -> None:
    first = _out([1, 2, 3], [("a", 0, 2), ("b", 2, 3)], "abort")
    more = _out([4, 5], [("b", 0, 1), ("c", 1, 2)], "length")
    both = splice(first, more)
    assert _spans(both) == [("a", 0, 2), ("b", 2, 4), ("c", 4, 5)]
    assert both.meta_info.weight_version == "c" and both.meta_info.completion_tokens == 5
    assert both.meta_info.token_versions(5) == ["a", "a", "b", "b", "c"]
    assert both.output_ids == [1, 2, 3, 4, 5] and len(both.meta_info.output_token_logprobs) == 5
    # a continuation aborted before its first token: the answer's spans are the first part's (SGLang's
    # weight_version is then the last span's version, not the engine's newer one)
    empty = splice(first, _out([], [("d", 0, 0)], "abort"))
    assert _spans(empty) == [("a", 0, 2), ("b", 2, 3)] and empty.meta_info.weight_version == "b"
    # nothing generated at all: one empty span of the continuation's version
    assert _spans(splice(_out([], [("a", 0, 0)], "abort"), _out([], [("d", 0, 0)], "abort"))) == [("d", 0, 0)]


class _Engine:
    """A fake ``EngineClient.generate`` that records calls and what was registered when each was sent."""

    def __init__(self, answers: list[GenerateOutput] | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.registered: list[str] = []
        self.aborted: set[str] = set()
        self.answers = list(answers or [])

    def register(self, rid: str) -> None:
        self.registered.append(rid)

    async def generate(self, input_ids: list[int], params: dict[str, Any], *, rid: str | None = None,
                       **kw: Any) -> list[GenerateOutput]:
        self.calls.append({"input_ids": input_ids, "params": params, "rid": rid,
                           "registered": list(self.registered)})
        await asyncio.sleep(0)
        if self.answers:
            return [self.answers.pop(0)]
        n = params["max_new_tokens"]
        return [_out(list(range(n)), [("1", 0, n)], "length", rid=rid or "")]


def test_n_samples_are_separate_engine_requests_registered_before_sending() -> None:
    eng = _Engine()
    params = {"max_new_tokens": 4, "n": 3, "temperature": 1.0, "sampling_seed": 2**63 - 2}
    outs, continued = asyncio.run(generate_continuing(eng.generate, PROMPT, params, rid="chat-1",
                                                      aborted_by_us=eng.aborted.__contains__,
                                                      max_continuations=2, register=eng.register))
    assert len(outs) == 3 and continued == 0
    assert sorted(c["rid"] for c in eng.calls) == ["chat-1_0", "chat-1_1", "chat-1_2"]
    assert all(c["registered"][:3] == ["chat-1_0", "chat-1_1", "chat-1_2"] for c in eng.calls)
    by_rid = {c["rid"]: c["params"] for c in eng.calls}
    assert all(p["n"] == 1 and p["max_new_tokens"] == 4 for p in by_rid.values())
    # seed + i, kept in SGLang's range
    assert [by_rid[f"chat-1_{i}"]["sampling_seed"] for i in range(3)] == [2**63 - 2, 2**63 - 1, 0]
    assert [o.meta_info.id for o in outs] == ["chat-1_0", "chat-1_1", "chat-1_2"]  # in sample order
    assert params["n"] == 3 and params["sampling_seed"] == 2**63 - 2  # the caller's dict is untouched


def test_continuation_is_registered_before_it_is_sent_and_an_abort_then_stops_it() -> None:
    eng = _Engine([_out([7, 8], [("1", 0, 2)], "abort", rid="chat-2")])
    params = {"max_new_tokens": 5, "n": 1, "sampling_seed": 10}
    outs, continued = asyncio.run(generate_continuing(eng.generate, PROMPT, params, rid="chat-2",
                                                      aborted_by_us=eng.aborted.__contains__,
                                                      max_continuations=2, register=eng.register))
    assert continued == 1 and outs[0].output_ids == [7, 8, 0, 1, 2]
    cont = eng.calls[1]
    assert cont["rid"] == "chat-2-cont0" and "chat-2-cont0" in cont["registered"]
    assert cont["input_ids"] == PROMPT + [7, 8] and cont["params"]["max_new_tokens"] == 3
    assert cont["params"]["sampling_seed"] == 12

    # the session abort lands while the continuation is being registered: it is never sent
    eng = _Engine([_out([7, 8], [("1", 0, 2)], "abort", rid="chat-3")])

    def register(rid: str) -> None:
        eng.register(rid)
        if rid.endswith("-cont0"):
            eng.aborted.update(eng.registered)

    outs, continued = asyncio.run(generate_continuing(eng.generate, PROMPT, params, rid="chat-3",
                                                      aborted_by_us=eng.aborted.__contains__,
                                                      max_continuations=2, register=register))
    assert len(eng.calls) == 1 and continued == 0
    assert outs[0].output_ids == [7, 8] and outs[0].meta_info.finish_reason.type == "abort"


def test_a_constrained_sample_is_generated_again_not_continued() -> None:
    """Issue 42: a sample decoded under a grammar cannot go on from prompt + its tokens (the grammar would start
    again at the cut): after an engine-side abort it is generated again from its prompt, whole."""
    eng = _Engine([_out([7, 8], [("1", 0, 2)], "abort", rid="chat-g")])
    params = {"max_new_tokens": 5, "n": 1, "sampling_seed": 10, "json_schema": '{"type": "object"}'}
    outs, continued = asyncio.run(generate_continuing(eng.generate, PROMPT, params, rid="chat-g",
                                                      aborted_by_us=eng.aborted.__contains__,
                                                      max_continuations=2, register=eng.register))
    again = eng.calls[1]
    assert continued == 1 and again["input_ids"] == PROMPT and again["params"]["max_new_tokens"] == 5
    assert again["params"]["json_schema"] == '{"type": "object"}' and again["params"]["sampling_seed"] != 10
    assert outs[0].output_ids == [0, 1, 2, 3, 4]  # the second answer alone, not spliced onto the first


def test_a_sample_aborted_before_it_is_sent_is_not_sent() -> None:
    eng = _Engine()

    def register(rid: str) -> None:
        eng.register(rid)
        if rid == "chat-4_1":
            eng.aborted.add(rid)

    params = {"max_new_tokens": 3, "n": 2}
    outs, _ = asyncio.run(generate_continuing(eng.generate, PROMPT, params, rid="chat-4",
                                              aborted_by_us=eng.aborted.__contains__, max_continuations=2,
                                              register=register))
    assert [c["rid"] for c in eng.calls] == ["chat-4_0"]
    assert outs[1].output_ids == [] and outs[1].meta_info.finish_reason.type == "abort"
    assert outs[1].meta_info.token_versions(0) == []


def test_an_abort_is_sent_again_while_its_request_still_runs() -> None:
    """The first abort reached the engine before the request (lost); the second one stops it."""
    sent: list[list[str]] = []

    async def run() -> list[GenerateOutput]:
        stopped = asyncio.Event()

        async def generate(input_ids: list[int], params: dict[str, Any], *, rid: str | None = None,
                           **kw: Any) -> list[GenerateOutput]:
            await stopped.wait()
            return [_out([1], [("1", 0, 1)], "abort", rid=rid or "")]

        async def abort(rids: list[str]) -> None:
            sent.append(rids)
            if len(sent) == 2:
                stopped.set()

        call = abort_resending(generate, {"r-1"}.__contains__, abort, interval=0.01)
        not_ours = abort_resending(generate, {"r-1"}.__contains__, abort, interval=0.01)
        other = asyncio.ensure_future(not_ours(PROMPT, {}, rid="r-2"))
        out = await asyncio.wait_for(call(PROMPT, {}, rid="r-1"), 10)
        await asyncio.wait_for(other, 10)
        return out

    out = asyncio.run(run())
    assert out[0].meta_info.finish_reason.type == "abort"
    assert sent[:2] == [["r-1"], ["r-1"]] and all(s == ["r-1"] for s in sent)  # r-2 was never aborted


class _FailingEngine(_Engine):
    """Fails the calls numbered in ``failures`` (0-based) as a dead engine behind the router does (with
    the error ``EngineClient`` raises then); answers the others as ``_Engine`` does."""

    def __init__(self, failures: dict[int, EngineError], answers: list[GenerateOutput] | None = None) -> None:
        super().__init__(answers)
        self.failures = failures

    async def generate(self, input_ids: list[int], params: dict[str, Any], *, rid: str | None = None,
                       **kw: Any) -> list[GenerateOutput]:
        error = self.failures.get(len(self.calls))
        if error is not None:
            self.calls.append({"input_ids": input_ids, "rid": rid, "failed": True})
            raise error
        return await super().generate(input_ids, params, rid=rid, **kw)


def _dead() -> EngineError:
    return EngineError(503, "inference backend unreachable", code="engine_unavailable")


def test_a_generation_whose_engine_failed_is_sent_again_under_a_fresh_registered_rid(monkeypatch) -> None:
    monkeypatch.setattr(partial, "RETRY_BACKOFF_S", (0.0,))
    eng = _FailingEngine({0: _dead(), 1: EngineError(502, "backend error 502", code="engine_error")})
    outs, _ = asyncio.run(generate_continuing(eng.generate, PROMPT, {"max_new_tokens": 3}, rid="chat-9",
                                              aborted_by_us=lambda r: False, max_continuations=3,
                                              register=eng.register, engine_retries=2))
    assert [c["rid"] for c in eng.calls] == ["chat-9", "chat-9-retry1", "chat-9-retry2"]
    assert eng.registered == ["chat-9", "chat-9-retry1", "chat-9-retry2"]  # a session abort reaches each
    assert outs[0].output_ids == [0, 1, 2] and all(c["input_ids"] == PROMPT for c in eng.calls)
    # an engine-side abort, then the continuation's engine dies: only the continuation is sent again
    eng = _FailingEngine({1: _dead()}, [_out([7, 8], [("1", 0, 2)], "abort", rid="chat-10")])
    outs, continued = asyncio.run(generate_continuing(eng.generate, PROMPT, {"max_new_tokens": 4}, rid="chat-10",
                                                      aborted_by_us=lambda r: False, max_continuations=3,
                                                      register=eng.register, engine_retries=2))
    assert [c["rid"] for c in eng.calls] == ["chat-10", "chat-10-cont0", "chat-10-cont0-retry1"]
    assert eng.calls[2]["input_ids"] == PROMPT + [7, 8] and eng.calls[2]["params"]["max_new_tokens"] == 2
    assert outs[0].output_ids == [7, 8, 0, 1] and continued == 1


def test_engine_retries_stop_at_the_budget_a_refusal_or_a_session_abort(monkeypatch) -> None:
    monkeypatch.setattr(partial, "RETRY_BACKOFF_S", (0.0,))

    def run(eng: _FailingEngine, retries: int, aborted: bool = False) -> None:
        asyncio.run(generate_continuing(eng.generate, PROMPT, {"max_new_tokens": 2}, rid="chat-11",
                                        aborted_by_us=lambda r: aborted and len(eng.calls) > 0,
                                        max_continuations=0, engine_retries=retries))

    eng = _FailingEngine({0: _dead(), 1: _dead(), 2: _dead()})
    with pytest.raises(EngineError) as exc:
        run(eng, retries=2)
    assert exc.value.status == 503 and len(eng.calls) == 3  # the first try and 2 retries
    eng = _FailingEngine({0: EngineError(400, "engine rejected the request: too long", code="engine_rejected")})
    with pytest.raises(EngineError):
        run(eng, retries=5)
    assert len(eng.calls) == 1  # the client's fault: never sent again
    eng = _FailingEngine({0: _dead()})
    with pytest.raises(EngineError):
        run(eng, retries=5, aborted=True)
    assert len(eng.calls) == 1  # the session aborted it: not sent again


class _StreamingEngine:
    """A fake ``EngineClient.generate_stream``: per call, a script of cumulative events (token ids so far and a
    finish reason on the last), ending in an exception, a cut (no final event) or normally."""

    def __init__(self, scripts: list[tuple[list[int], str | None, BaseException | None]]) -> None:
        self.scripts = list(scripts)
        self.calls: list[dict[str, Any]] = []
        self.registered: list[str] = []

    async def stream(self, input_ids: list[int], params: dict[str, Any], *, rid: str | None = None, **kw: Any):
        self.calls.append({"input_ids": list(input_ids), "params": dict(params), "rid": rid})
        ids, finish, error = self.scripts.pop(0)
        for k in range(1, len(ids) + 1):
            out = _out(ids[:k], [("1", 0, k)], finish or "length", rid=rid or "")
            if k < len(ids) or finish is None:  # under way (or cut: no final event at all)
                out.meta_info.finish_reason = None
            yield out
        if error is not None:
            raise error


def _streamed(eng: _StreamingEngine, **kw: Any) -> list[GenerateOutput]:
    async def run() -> list[GenerateOutput]:
        events = []
        async for out in partial.stream_samples(eng.stream, PROMPT, {"max_new_tokens": 6}, "chat-20",
                                                aborted=kw.pop("aborted", lambda r: False), abort=_no_abort,
                                                register=eng.registered.append, **kw):
            events.append(out)
        return events

    return asyncio.run(run())


async def _no_abort(rids: list[str]) -> int:
    return 0


def test_a_stream_goes_on_after_an_engine_abort_and_after_its_engine_died(monkeypatch) -> None:
    monkeypatch.setattr(partial, "RETRY_BACKOFF_S", (0.0,))
    # an engine-side abort after 2 tokens: not shown; the rest is asked for from prompt + those 2 tokens
    eng = _StreamingEngine([([5, 6], "abort", None), ([7, 8, 9, 10], "length", None)])
    events = _streamed(eng, max_continuations=2)
    assert [c["rid"] for c in eng.calls] == ["chat-20", "chat-20-cont0"] and eng.registered == ["chat-20-cont0"]
    assert eng.calls[1]["input_ids"] == PROMPT + [5, 6] and eng.calls[1]["params"]["max_new_tokens"] == 4
    assert not [e for e in events if e.meta_info.finish_reason and e.meta_info.finish_reason.type == "abort"]
    assert [e.output_ids for e in events][-1] == [5, 6, 7, 8, 9, 10]  # cumulative across the seam
    assert [len(e.output_ids) for e in events] == sorted(len(e.output_ids) for e in events)
    # the engine dies after 3 tokens (the connection drops), then a stream is cut before its final event
    dead = EngineError(503, "inference backend unreachable", code="engine_unavailable")
    eng = _StreamingEngine([([5, 6, 7], None, dead), ([8], None, None), ([9, 10], "length", None)])
    events = _streamed(eng, engine_retries=3)
    assert [c["rid"] for c in eng.calls] == ["chat-20", "chat-20-retry1", "chat-20-retry2"]
    assert [c["input_ids"] for c in eng.calls] == [PROMPT, PROMPT + [5, 6, 7], PROMPT + [5, 6, 7, 8]]
    assert events[-1].output_ids == [5, 6, 7, 8, 9, 10] and events[-1].meta_info.finish_reason.type == "length"
    assert len(events[-1].meta_info.output_token_logprobs) == 6
    # cut after its last token, before the final event: finished at its length, nothing asked for again
    eng = _StreamingEngine([([5, 6, 7, 8, 9, 10], None, dead)])
    last = _streamed(eng, engine_retries=3)[-1]
    assert len(eng.calls) == 1 and last.output_ids == [5, 6, 7, 8, 9, 10]
    assert last.meta_info.finish_reason == FinishReason(type="length", length=6)
    # a stream that ends with no event at all ([DONE] at once) is a failure too: sent again
    eng = _StreamingEngine([([], None, None), ([5, 6, 7, 8, 9, 10], "length", None)])
    assert _streamed(eng, engine_retries=1)[-1].output_ids == [5, 6, 7, 8, 9, 10] and len(eng.calls) == 2


def test_a_stream_stops_going_on_at_the_budget_a_refusal_or_a_session_abort(monkeypatch) -> None:
    monkeypatch.setattr(partial, "RETRY_BACKOFF_S", (0.0,))
    dead = EngineError(503, "inference backend unreachable", code="engine_unavailable")
    eng = _StreamingEngine([([5], None, dead), ([6], None, dead)])
    with pytest.raises(EngineError):
        _streamed(eng, engine_retries=1)
    assert len(eng.calls) == 2  # the first try and 1 retry
    eng = _StreamingEngine([([], None, EngineError(400, "engine rejected the request", code="engine_rejected"))])
    with pytest.raises(EngineError):
        _streamed(eng, engine_retries=5)
    assert len(eng.calls) == 1  # the client's fault: never sent again
    # out of continuations: the abort ends the stream and is shown
    eng = _StreamingEngine([([5, 6], "abort", None)])
    events = _streamed(eng, max_continuations=0)
    assert len(eng.calls) == 1 and events[-1].meta_info.finish_reason.type == "abort"
    # the session aborted it: the engine's abort is its final event, nothing goes on
    eng = _StreamingEngine([([5, 6], "abort", None)])
    events = _streamed(eng, max_continuations=3, aborted=lambda r: True)
    assert eng.calls == [] and events[-1].meta_info.finish_reason.type == "abort"  # aborted before it was sent
    eng = _StreamingEngine([([5, 6], "abort", None)])
    calls = eng.calls
    events = _streamed(eng, max_continuations=3, aborted=lambda r: len(calls) > 0)
    assert len(eng.calls) == 1 and events[-1].output_ids == [5, 6] and events[-1].meta_info.finish_reason.type == "abort"
