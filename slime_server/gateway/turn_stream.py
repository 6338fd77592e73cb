"""One turn, streamed: the engine's cumulative outputs -> per-choice reasoning/content/tool-call deltas.

Why apart from the protocols: Chat Completions chunks, Responses events and Anthropic Messages events
are three renderings of the same deltas. This module holds what they share: the UTF-8 and stop-string
hold-back (streamed text always equals the non-streamed text), the incremental reasoning and tool-call
parsers, and the durable record of the turn, which ``turn_events`` commits *before* it yields the
final ``StreamEnd`` (so every API's final event follows the commit).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from slime_server.gateway.core import Gateway
from slime_server.gateway.engine_client import EngineError
from slime_server.gateway.protocol import ChoiceLogprobs, DeltaMessage
from slime_server.gateway.token_text import streamable
from slime_server.gateway.turn import ChatTurn, TurnResult, answer_text, build_message, token_logprobs
from slime_server.rollout.protocol import GenerateOutput


@dataclass
class StreamDelta:
    """New text of choice ``index``: reasoning, content and/or whole tool calls, and their logprobs."""

    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None


@dataclass
class StreamEnd:
    """The turn is recorded: each choice's last delta (parser flush), reasons, the parsed result."""

    finals: list[DeltaMessage]
    finish_reasons: list[str]
    result: TurnResult

    @property
    def usage(self):
        return self.result.usage


class ChoiceStream:
    """Per-choice streaming state: cumulative engine output -> reasoning/content/tool-call deltas."""

    def __init__(self, gw: Gateway, turn: ChatTurn) -> None:
        self.gw = gw
        self.text = ""
        self.n_logprobs = 0
        self.last: GenerateOutput | None = None
        self.reasoning = gw.reasoning.streaming() if gw.reasoning else None
        self.tools = gw.tool_parser.streaming() if turn.parse_tools else None
        self.pending = turn.prefill  # prefill text is fed to the parsers before the first delta
        stop = turn.req.stop
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])

    def step(self, out: GenerateOutput, with_logprobs: bool) -> tuple[DeltaMessage, ChoiceLogprobs | None]:
        self.last = out
        if out.meta_info.finish_reason is None:
            # Hold back a trailing partial character (U+FFFD until its next token arrives) and, since the
            # engine trims a matched stop string only from the final text, any tail that could still
            # become one: streamed text always equals the non-streamed text.
            text = streamable(out.text)
            text = text[: len(text) - stop_prefix_len(text, self.stops)]
        else:
            text = answer_text(self.gw, out)
        delta_text = self.pending + text[len(self.text):]
        self.pending = ""
        self.text = max(self.text, text, key=len)
        lp = None
        if with_logprobs:
            entries = token_logprobs(self.gw, out, self.n_logprobs)
            self.n_logprobs += len(entries)
            lp = ChoiceLogprobs(content=entries)
        return self._parse(delta_text, final=False), lp

    def finish(self) -> DeltaMessage:
        return self._parse("", final=True)

    def _parse(self, text: str, final: bool) -> DeltaMessage:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if final:
                r2, t2 = self.reasoning.finish()
                reasoning, text = reasoning + r2, text + t2
        delta = DeltaMessage(reasoning_content=reasoning or None)
        if self.tools is not None:
            d = self.tools.feed(text)
            content, calls = d.content, list(d.tool_calls)
            if final:
                d2 = self.tools.finish()
                content, calls = content + d2.content, calls + d2.tool_calls
            delta.content = content or None
            delta.tool_calls = calls or None
        else:
            delta.content = text or None
        return delta


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop), len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def has_text(delta: DeltaMessage, lp: ChoiceLogprobs | None = None) -> bool:
    return bool(delta.content or delta.reasoning_content or delta.tool_calls or (lp and lp.content))


async def turn_events(gw: Gateway, turn: ChatTurn, call: dict[str, Any], *,
                      with_logprobs: bool = False) -> AsyncIterator[StreamDelta | StreamEnd]:
    """Deltas as the engine streams them, then (after the durable commit) one ``StreamEnd``.

    Raises ``APIError`` (engine failure, store failure) for the caller to render in its API's format.
    """
    n = turn.req.n
    states = [ChoiceStream(gw, turn) for _ in range(n)]
    # an engine that fails or aborts mid-stream is continued inside (gateway/partial.py): the client's stream
    # carries on where it was; an error reaches here only when the retries are spent or it is the client's
    async for out in gw.generate_stream(turn.prepared.session_id, turn.response_id, call["input_ids"],
                                        call["sampling_params"], return_logprob=True,
                                        **{k: v for k, v in call.items() if k not in ("input_ids", "sampling_params")}):
        i = out.index or 0
        if not 0 <= i < n:
            continue
        delta, lp = states[i].step(out, with_logprobs)
        if has_text(delta, lp):
            yield StreamDelta(index=i, delta=delta, logprobs=lp)
    if any(s.last is None for s in states):
        raise EngineError(502, "the engine stream ended without a result for every choice", code="bad_engine_response")
    finals = [s.finish() for s in states]
    outs = [s.last for s in states if s.last is not None]
    messages = [build_message(gw, turn.prefill + answer_text(gw, o), turn.parse_tools) for o in outs]
    usage = await turn.record(outs, messages)  # durable before the final event
    result = TurnResult(outs=outs, messages=messages, usage=usage)
    yield StreamEnd(finals=finals, finish_reasons=result.finish_reasons(), result=result)
