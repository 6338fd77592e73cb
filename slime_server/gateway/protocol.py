"""Pydantic models of the OpenAI wire formats the gateway speaks (and our session REST API).

Why one module: every byte that crosses the /v1 boundary is validated or produced by a model
here, so FastAPI's OpenAPI schema is the real contract and bad input fails with a clear 400
(see errors.py) before any engine or store is touched. Field names and defaults follow the
OpenAI API reference one to one; a few SGLang sampling extras (top_k, min_p) are accepted too.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Limits that protect the engines from absurd requests; the app may lower them.
MAX_N = 16
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # the engines' sampling_seed is a non-negative 64-bit integer


def new_id(prefix: str) -> str:
    """OpenAI-style opaque id (``chatcmpl-…``, ``cmpl-…``, ``call_…``)."""
    sep = "_" if prefix == "call" else "-"
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class WireModel(BaseModel):
    """Requests ignore unknown fields (as OpenAI does for forward compatibility) and, like OpenAI, refuse
    wrongly typed values (``"n": "2"``, ``"stream": "yes"``) instead of coercing them: the published
    schema is then exactly what is accepted."""

    model_config = ConfigDict(extra="ignore", strict=True)


# ----------------------------------------------------------------------------- messages


class TextContentPart(WireModel):
    type: Literal["text"]
    text: str


class ImageURL(WireModel):
    url: str = Field(description="a data URL (data:image/png;base64,...); an http(s) URL only where the server "
                     "fetches them (gateway.fetch_image_urls)")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted; the model's image processor "
                                                          "decides the resolution")


class ImageURLContentPart(WireModel):
    """An image (vision-language models; user messages, and tool results through Responses and Messages)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageURLContentPart, Field(discriminator="type")]


class FunctionCall(WireModel):
    name: str
    arguments: str = Field(description="JSON-encoded arguments, exactly as the model produced them")


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    """One input message; ``role`` is checked here so an invalid role is a 400, not a template error."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(WireModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(WireModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(WireModel):
    include_usage: bool = False


class JSONSchemaSpec(WireModel):
    """``response_format.json_schema``: the schema the answer must validate against (always enforced, ``strict``
    or not: the engines decode under it)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextResponseFormat(WireModel):
    type: Literal["text"]


class JSONObjectResponseFormat(WireModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(WireModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextResponseFormat | JSONObjectResponseFormat | JSONSchemaResponseFormat,
                           Field(discriminator="type")]


# ----------------------------------------------------------------------------- chat request


class ChatCompletionRequest(WireModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="SGLang extra; -1 (or 0) disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="SGLang extra")
    ignore_eos: bool = Field(False, description="SGLang extra: generate exactly max_tokens (benchmarks)")
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    metadata: dict[str, str] | None = None


# ----------------------------------------------------------------------------- chat response


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ----------------------------------------------------------------------------- completions


class CompletionRequest(WireModel):
    model: str
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logprobs: int | None = Field(None, ge=0, le=5)
    stream: bool = False
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    metadata: dict[str, str] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ----------------------------------------------------------------------------- models, errors


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "slime-server"
    parent: str | None = Field(None, description="a LoRA adapter's base model (SGLang's field); absent for the base")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ----------------------------------------------------------------------------- sessions REST


class CreateSessionRequest(WireModel):
    group_id: str | None = Field(None, max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)
    with_key: bool = Field(False, description="also mint a per-session API key that reaches only this session")


class SessionCreated(BaseModel):
    id: str
    object: Literal["session"] = "session"
    group_id: str | None = None
    api_key: str | None = Field(None, description="shown once; only its hash is stored")


class RewardRequest(WireModel):
    """A scalar reward for the whole session, or one reward per turn (in turn order)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [  # exactly one of the two (else 400)
        {"required": ["reward"], "properties": {"reward": {"type": "number"}}},
        {"required": ["turn_rewards"], "properties": {"turn_rewards": {"type": "array"}}}]})
    reward: float | None = Field(None, allow_inf_nan=False)
    turn_rewards: list[Annotated[float, Field(allow_inf_nan=False)]] | None = None
    idempotency_key: str | None = Field(None, max_length=200)
    final: bool | None = Field(None, description="whether this reward is the episode's outcome and finishes the "
                               "session (its trajectories become trainable; later turns get 409). Default: true "
                               "for a scalar 'reward', false for 'turn_rewards' (they may arrive as the episode "
                               "goes on)")

    def finishes(self) -> bool:
        return self.final if self.final is not None else self.reward is not None


class RewardResult(BaseModel):
    session_id: str
    changed: bool
    finished: bool = Field(False, description="the reward finished the session (see RewardRequest.final)")


class FeedbackRequest(WireModel):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # a thumb, a score or both (else 400)
        {"required": ["thumb"], "properties": {"thumb": {"enum": ["up", "down"]}}},
        {"required": ["score"], "properties": {"score": {"type": "number"}}}]})

    thumb: Literal["up", "down"] | None = None
    score: float | None = Field(None, allow_inf_nan=False)
    comment: str | None = Field(None, max_length=10_000)


class FeedbackResult(BaseModel):
    response_id: str
    session_id: str | None = None
    recorded: bool = True


class SessionClosed(BaseModel):
    id: str
    status: str
