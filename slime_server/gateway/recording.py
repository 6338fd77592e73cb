"""The gateway's one seam to the session layer: prepare a turn's prompt ids, commit its results.

Why a seam: gateway/sessions.py owns token-exact multi-turn assembly and durability; the gateway must
only (1) ask it for the prompt ids, (2) append tool-call prefill tokens as *prompt* tokens, and
(3) commit every choice before the response leaves. Blocking store work runs in a worker thread
so a slow fsync never stalls the event loop serving other requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from slime_server.gateway.errors import APIError
from slime_server.gateway.protocol import ResponseMessage, Usage, new_id
from slime_server.gateway.threads import in_thread

TOKENS = Counter("slime_recorded_tokens_total", "tokens of recorded turns, as billed in usage", ["kind"])


@dataclass
class ChoiceOutcome:
    """One generated choice, ready to be recorded."""

    index: int
    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: int | str | list[int | str] | None
    finish_reason: str  # engine's: stop | length | abort
    message: ResponseMessage
    grammar: dict[str, str] | None = None  # the sampling_params grammar it was decoded under (constraints.py)
    lora_adapter: str | None = None  # the LoRA adapter that generated it (None: the base)
    routed_experts: Any = None  # an MoE model's routes from the turn's routes_start (buffer/routed_experts.py)


async def prepare_turn(sessions: Any, session_id: str | None, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, n: int, prefill_ids: list[int],
                       owner: str | None = None) -> Any:
    """Prompt ids for this turn (``prepared.prompt_ids``), with ``prefill_ids`` appended as prompt."""
    prepared = await in_thread(call_store, sessions.prepare_turn, session_id, messages, tools, n=n,
                                       owner=owner)
    if prefill_ids:
        prepared.prompt_ids = list(prepared.prompt_ids) + list(prefill_ids)
    return prepared


async def prepare_raw(store: Any, session_id: str | None, prompt_ids: list[int], n: int,
                      owner: str | None = None) -> Any:
    """A turn for ``/v1/completions``: raw prompt ids, always a fresh trajectory (new segment)."""
    from slime_server.gateway.sessions import PreparedTurn  # lazy: loads transformers

    if session_id is None:
        return PreparedTurn(session_id=new_id("sess"), ephemeral=True, mode="new", prompt_ids=prompt_ids,
                            messages=[], n=n, owner=owner)

    def segment() -> int:
        store.get_or_create_session(session_id, owner=owner)
        return max((t.segment for t in store.get_trajectories(session_id)), default=-1) + 1

    seg = await in_thread(call_store, segment)
    return PreparedTurn(session_id=session_id, mode="new", segment=seg, prompt_ids=prompt_ids, messages=[], n=n,
                        owner=owner)


async def commit_turn(sessions: Any, prepared: Any, outcomes: list[ChoiceOutcome], response_id: str,
                      usage: Usage) -> list[Any]:
    """Durably record every choice; returns the session layer's turn records."""
    from slime_server.gateway.sessions import ChoiceResult  # lazy: loads transformers

    choices = [
        ChoiceResult(
            output_ids=o.output_ids, output_logprobs=o.output_logprobs, weight_version=o.weight_version,
            finish_reason=o.finish_reason, message=o.message.model_dump(exclude_none=True),
            response_id=response_id, usage=usage.model_dump(), grammar=o.grammar, lora_adapter=o.lora_adapter,
            routed_experts=o.routed_experts,
        )
        for o in outcomes
    ]
    records = await in_thread(call_store, sessions.commit_turn, prepared, choices)
    TOKENS.labels("prompt").inc(usage.prompt_tokens)
    TOKENS.labels("completion").inc(usage.completion_tokens)
    return records


def call_store(fn, *args: Any, **kwargs: Any) -> Any:
    """Call the session layer / store, mapping its typed errors (``status_code``, ``code``) to HTTP."""
    try:
        return fn(*args, **kwargs)
    except APIError:
        raise
    except Exception as e:
        from slime_server.gateway.chat_template import ChatTemplateError  # lazy: loads transformers

        if isinstance(e, ChatTemplateError):  # the conversation cannot be rendered: the client's input
            raise APIError(400, str(e), param=e.param, code=e.code) from e
        status = getattr(e, "status_code", None) or getattr(e, "http_status", None)
        if isinstance(status, int) and 400 <= status < 600:  # 4xx: the request; 503: the store (disk full, read-only)
            raise APIError(status, str(e), code=getattr(e, "code", None)) from e
        if isinstance(e, LookupError):
            raise APIError(404, str(e) or "not found", code="not_found") from e
        raise
