"""One generation turn, whatever API it came through: validation, sampling, the session, the record.

Why one core: Chat Completions, Responses and Anthropic Messages are three wire formats over the same
turn. Each protocol module translates its request into a ``ChatCompletionRequest`` (the canonical
internal request), and this module resolves the session, renders prompt ids token-exactly, builds
SGLang's sampling parameters, parses reasoning and tool calls once (the model family's parsers) and
records every choice before any answer leaves.

Tool choice ``required`` / named (documented behaviour): the gateway *prefills* the start of a
call, ``<tool_call>\\n{"name": "`` (plus ``NAME", "arguments":`` for a named choice), after the
rendered prompt. The prefilled tokens are sent and recorded as PROMPT tokens (loss mask 0): the
model did not generate them. The parser sees prefill + generated text, so the answer carries a
normal ``tool_calls`` entry; ``usage.prompt_tokens`` includes the prefill.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from slime_server.gateway import constraints, recording, routes
from slime_server.gateway.adapters import AdapterRoute
from slime_server.gateway.core import Gateway
from slime_server.gateway.engine_client import EngineError
from slime_server.gateway.errors import APIError, bad_request
from slime_server.gateway.images import EngineImages, TurnImages, image_reader
from slime_server.gateway.principal import Principal
from slime_server.gateway.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    NamedToolChoice,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    new_id,
)
from slime_server.gateway.sessions_resolve import resolve_session
from slime_server.gateway.token_text import final_text, token_string
from slime_server.rollout.protocol import GenerateOutput

MIN_TOP_P = 1e-6  # smaller top_p values are sent as this (see sampling_params)
STORED_IMAGES_REMEMBERED = 4096  # hashes of images this gateway stored, not sent to the store again


# ----------------------------------------------------------------------------- validation


def canonical_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """Another API's request as the canonical chat request (None fields left out); a field the chat request
    refuses is a 400 naming it, as the other API called it where the names agree."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}, strict=False)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}", param=where or None) from None


def check_model(gw: Gateway, model: str) -> str | None:
    """The LoRA adapter ``model`` names (None: the served model itself). SGLang's convention: ``<served>:<adapter>``
    picks an adapter the engines have loaded (an unknown one is the engines' refusal, a 404 here too); any other
    name is a 404."""
    if model == gw.model_name:
        return None
    base, colon, adapter = model.partition(":")
    if colon and base.strip() == gw.model_name and adapter.strip():
        return adapter.strip()
    raise APIError(404, f"the model '{model}' does not exist; this server serves '{gw.model_name}' (and its LoRA "
                   f"adapters as '{gw.model_name}:<adapter>')", code="model_not_found", param="model")


def validate_chat(gw: Gateway, req: ChatCompletionRequest) -> None:
    """Everything pydantic cannot check alone; each failure is a 400 naming the parameter."""
    check_model(gw, req.model)
    if req.n > gw.settings.max_n:
        raise bad_request(f"n must be <= {gw.settings.max_n}", param="n")
    for i, tool in enumerate(req.tools or []):
        params = tool.function.parameters
        if params is None:
            continue
        error = constraints.schema_error(json.dumps(params, sort_keys=True))
        if error is not None:
            raise bad_request(f"tools[{i}].function.parameters is not a valid JSON Schema: {error}",
                              param=f"tools[{i}].function.parameters")
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", param="tools")
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice names '{choice.function.name}', which is not in tools", param="tool_choice")
    if choice == "required" and not names:
        raise bad_request("tool_choice 'required' needs at least one tool", param="tool_choice")
    check_penalties(gw, req.frequency_penalty, req.presence_penalty)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


def check_penalties(gw: Gateway, frequency: float | None, presence: float | None) -> None:
    if gw.settings.engine_supports_penalties:
        return
    for name, value in (("frequency_penalty", frequency), ("presence_penalty", presence)):
        if value:
            raise bad_request(f"{name} is not supported by the inference engine of this server",
                              param=name, code="unsupported_parameter")


# ----------------------------------------------------------------------------- sampling


def sampling_params(gw: Gateway, *, prompt_len: int, max_tokens: int | None, temperature: float | None,
                    top_p: float | None, top_k: int | None, min_p: float | None, stop: str | list[str] | None,
                    seed: int | None, n: int, frequency_penalty: float | None,
                    presence_penalty: float | None, ignore_eos: bool = False) -> dict[str, Any]:
    """SGLang ``sampling_params``; refuses prompts that leave no room in the context (400)."""
    ctx = int(gw.renderer.context_length)
    room = ctx - prompt_len
    if room <= 0:
        raise bad_request(f"the prompt is {prompt_len} tokens; this model's context is {ctx} tokens",
                          param="messages", code="context_length_exceeded")
    limit = gw.settings.max_prompt_tokens
    if limit is not None and prompt_len > limit:
        raise bad_request(f"the prompt is {prompt_len} tokens; this server accepts at most {limit}",
                          param="messages", code="prompt_too_long")
    if max_tokens is not None and max_tokens > room:
        raise bad_request(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                          f"context length ({ctx})", param="max_tokens", code="context_length_exceeded")
    cap = gw.settings.max_output_tokens
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise bad_request(f"max_tokens ({max_tokens}) is above this server's limit ({cap})",
                          param="max_tokens", code="max_tokens_too_large")
    default = room if cap is None else min(room, cap)
    params: dict[str, Any] = {"max_new_tokens": max_tokens or default, "n": n,
                              "temperature": 1.0 if temperature is None else temperature}
    if top_p is not None:  # the router reads floats as f32 (5e-324 -> 0.0, which the engine refuses); any
        top_p = max(top_p, MIN_TOP_P)  # top_p <= 1/vocab keeps only the top token: this changes no sample
    if top_k == 0:  # "disabled" in our docs; SGLang accepts only -1 for that
        top_k = -1
    for key, value in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p), ("sampling_seed", seed),
                       ("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if value is not None:
            params[key] = value
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if ignore_eos:
        params["ignore_eos"] = True
    return params


# ----------------------------------------------------------------------------- answers


def build_message(gw: Gateway, text: str, parse_tools: bool) -> ResponseMessage:
    """Split reasoning, then tool calls, out of the generated text (prefill included)."""
    reasoning = None
    if gw.reasoning is not None:
        split = gw.reasoning.parse(text)
        reasoning, text = split.reasoning, split.content
    calls: list[ToolCall] | None = None
    content: str | None = text
    if parse_tools:
        parsed = gw.tool_parser.parse(text)
        if parsed.calls:
            content = parsed.content
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in parsed.calls]
    return ResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls)


def finish_reason(engine_reason: str, message: ResponseMessage) -> str:
    if message.tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def token_logprobs(gw: Gateway, out: GenerateOutput, start: int = 0) -> list[TokenLogprob]:
    """OpenAI ``logprobs.content`` entries for output tokens ``start:``, each with the token's own bytes."""
    mi = out.meta_info
    entries = mi.output_token_logprobs or []
    tops = mi.output_top_logprobs or []
    token_bytes = gw.renderer.token_bytes
    result = []
    for i in range(start, len(entries)):
        lp, tid, _ = entries[i]
        data = token_bytes(tid)
        top = [TopLogprob(token=token_string(token_bytes(t)), logprob=float(p), bytes=list(token_bytes(t)))
               for p, t, _ in (tops[i] or [])] if i < len(tops) else []
        result.append(TokenLogprob(token=token_string(data), logprob=float(lp if lp is not None else 0.0),
                                   bytes=list(data), top_logprobs=top))
    return result


def answer_text(gw: Gateway, out: GenerateOutput) -> str:
    """The engine's text of a finished choice, less the U+FFFD of a character cut by the end of generation."""
    reason = out.meta_info.finish_reason
    by_token = reason is not None and reason.type == "stop" and isinstance(reason.matched, int)
    return final_text(out.text, out.output_ids, gw.renderer.token_bytes, stopped_by_token=by_token)


def outcome(out: GenerateOutput, index: int, message: ResponseMessage,
            grammar: dict[str, str] | None = None, lora_adapter: str | None = None,
            routed_experts: Any = None) -> recording.ChoiceOutcome:
    mi = out.meta_info
    logprobs = [float(e[0]) if e[0] is not None else 0.0 for e in (mi.output_token_logprobs or [])]
    versions = mi.token_versions(len(out.output_ids))
    return recording.ChoiceOutcome(index=index, output_ids=list(out.output_ids), output_logprobs=logprobs,
                                   weight_version=versions,
                                   finish_reason=mi.finish_reason.type if mi.finish_reason else "abort",
                                   message=message, grammar=grammar, lora_adapter=lora_adapter,
                                   routed_experts=routed_experts)


# ----------------------------------------------------------------------------- request flow


def check_image_tokens(prepared: Any, outs: list[GenerateOutput]) -> None:
    """The engine expanded the prompt's images to as many pads as the gateway recorded (else the trajectory would not
    be what the model saw: the engine's image-processor config differs from the one the gateway read)."""
    ours = sum(s.length for s in prepared.images)
    for o in outs:
        theirs = o.meta_info.image_tokens
        if ours and theirs is not None and theirs != ours:
            raise EngineError(502, f"the engine expanded the prompt's images to {theirs} tokens, the gateway to {ours}: "
                              "their image-processor configs differ", code="bad_engine_response")


def is_side_turn(header: str | None, metadata: dict[str, str] | None) -> bool:
    """``X-Turn-Type: side`` (or ``metadata.turn_type``): a tool-internal or background call."""
    value = (header or (metadata or {}).get("turn_type") or "main").strip().lower()
    if value not in ("main", "side"):
        raise bad_request(f"turn type must be 'main' or 'side', got {value!r}", param="X-Turn-Type")
    return value == "side"


class ChatTurn:
    """One chat request from validation to recorded result (shared by plain and streamed answers).

    A *side* turn (tool-internal or background call inside an agent's session) is served and
    recorded, but in a one-turn session of its own: it never merges into the session's trajectory,
    is never judged, and is not trained on unless someone rewards that one-turn session.
    """

    def __init__(self, gw: Gateway, req: ChatCompletionRequest, *, side: bool = False,
                 response_id: str | None = None) -> None:
        self.gw = gw
        self.req = req
        self.side = side
        self.response_id = response_id or new_id("chatcmpl")
        choice = req.tool_choice
        # a forced tool call or a response format: a prefilled call opening and the grammar (constraints.py)
        self.constraint = constraints.plan(gw.tool_parser, req.tools, choice, req.response_format)
        self.prefill = self.constraint.prefill
        self.parse_tools = bool(req.tools) and choice != "none"
        self.prepared: Any = None
        self.adapter = check_model(gw, req.model)  # the LoRA adapter (or alias) asked for (None: the base)
        self.images = TurnImages()  # the request's image files (gateway/images.py)
        self.route: AdapterRoute | None = None  # where it goes on the engines (prepare)

    async def prepare(self, principal: Principal, header_session_id: str | None) -> dict[str, Any]:
        """Resolve the session, get prompt ids, build the engine request."""
        req, gw = self.req, self.gw
        session_id = resolve_session(principal, header_session_id, req.metadata)  # checks the key's rights
        if self.side:
            session_id = None
        # the adapter asked for, or the caller's own (a per-user job's); one the engines lack: a 404 now, before a
        # stream starts
        self.route = await gw.adapters.for_call(self.adapter, principal)
        await gw.admit(session_id, req.metadata)
        messages = await image_reader(gw).canonical([m.model_dump(exclude_none=True) for m in req.messages], self.images)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prefill_ids = gw.renderer.encode(self.prefill) if self.prefill else []
        self.prepared = await recording.prepare_turn(gw.sessions, session_id, messages, tools, req.n, prefill_ids,
                                                     owner=principal.session_owner)
        self.prepared._images = [self.images.blobs[h] for h in self.images.new if h not in gw.stored_images]
        if gw.feedback is not None and not self.side:
            gw.feedback.on_turn_prepared(self.prepared, tools)
        prompt_ids = list(self.prepared.prompt_ids)
        params = sampling_params(
            gw, prompt_len=len(prompt_ids), max_tokens=req.max_completion_tokens or req.max_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, stop=req.stop,
            seed=req.seed, n=req.n, frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty, ignore_eos=req.ignore_eos)
        params.update(self.constraint.grammar or {})
        call = {"input_ids": prompt_ids, "sampling_params": params,
                "top_logprobs_num": (req.top_logprobs or 0) if req.logprobs else 0, "route": self.route,
                **routes.request_fields(gw, self.prepared)}
        if self.prepared.images:  # every image of the prompt, collapsed to SGLang's one pad each on the way out
            spans = self.prepared.images
            call["images"] = EngineImages(gw.renderer.vision.pad_id, spans, self.images.data_urls([s.sha256 for s in spans]))
        return call

    def usage(self, outs: list[GenerateOutput]) -> Usage:
        prompt = len(self.prepared.prompt_ids)
        completion = sum(len(o.output_ids) for o in outs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def record(self, outs: list[GenerateOutput], messages: list[ResponseMessage]) -> Usage:
        check_image_tokens(self.prepared, outs)
        usage = self.usage(outs)
        adapter = self.route.name if self.route is not None else None  # the version that answered
        start, n_prompt = self.prepared.routes_start, len(self.prepared.prompt_ids)
        outcomes = [outcome(o, i, m, self.constraint.grammar, adapter, routes.answer_routes(self.gw, o, n_prompt, start))
                    for i, (o, m) in enumerate(zip(outs, messages, strict=True))]
        await recording.commit_turn(self.gw.sessions, self.prepared, outcomes, self.response_id, usage)
        self.gw.stored_images.update((b.sha256, None) for b in self.prepared._images)
        while len(self.gw.stored_images) > STORED_IMAGES_REMEMBERED:
            self.gw.stored_images.popitem(last=False)
        return usage

    async def run(self, call: dict[str, Any]) -> TurnResult:
        """Generate every choice, parse it, record it (durable before this returns)."""
        gw = self.gw
        outs = await gw.generate(self.prepared.session_id, self.response_id, call["input_ids"],
                                 call["sampling_params"], return_logprob=True,
                                 **{k: v for k, v in call.items() if k not in ("input_ids", "sampling_params")})
        messages = [build_message(gw, self.prefill + answer_text(gw, o), self.parse_tools) for o in outs]
        usage = await self.record(outs, messages)
        return TurnResult(outs=outs, messages=messages, usage=usage)


@dataclass
class TurnResult:
    """A finished, recorded turn: the engine's outputs, the parsed messages, the usage billed."""

    outs: list[GenerateOutput]
    messages: list[ResponseMessage]
    usage: Usage

    def finish_reasons(self) -> list[str]:
        """OpenAI's finish reason of each choice (``stop``, ``length``, ``tool_calls``)."""
        return [finish_reason(engine_reason(o), m) for o, m in zip(self.outs, self.messages, strict=True)]


def engine_reason(out: GenerateOutput) -> str:
    """The engine's finish type (``stop``, ``length``, ``abort``); ``stop`` when it gave none."""
    return out.meta_info.finish_reason.type if out.meta_info.finish_reason else "stop"


def matched_stop(out: GenerateOutput) -> str | None:
    """The stop string that ended this output, if one did (not a stop token)."""
    reason = out.meta_info.finish_reason
    matched = getattr(reason, "matched", None) if reason is not None else None
    return matched if isinstance(matched, str) else None


