"""Pydantic models of the OpenAI Responses wire format (``POST /v1/responses``, ``GET /v1/responses/{id}``).

Field names follow the OpenAI API reference. Input items this server understands: messages (with
``input_text`` / ``output_text`` / ``refusal`` parts), ``function_call``, ``function_call_output`` and
``reasoning``; images, files and hosted-tool items are a 400 naming the item. Tools other than
``function`` (web search, file search, computer use, custom) run on OpenAI's side: they are accepted
and not offered to the model, so a harness that lists them still works.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from slime_server.gateway.protocol import WireModel


def new_item_id(prefix: str) -> str:
    """OpenAI-style ids: ``resp_…``, ``msg_…``, ``fc_…``, ``rs_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- input items


class InputText(WireModel):
    type: Literal["input_text"]
    text: str


class OutputTextParam(WireModel):
    type: Literal["output_text"]
    text: str


class RefusalParam(WireModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(WireModel):
    """An image: ``image_url`` a data URL (or an http(s) URL where the server fetches them); ``file_id`` is refused
    (no Files API here)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"


_KNOWN_PART_TYPES = ("input_text", "output_text", "refusal", "input_image")


class UnsupportedPart(WireModel):
    """``input_file``, ``input_audio``: refused with a 400 naming the part."""

    model_config = ConfigDict(extra="allow", strict=True)
    # Published as "any type but the three above": the union is a oneOf, which a part that two branches' schemas
    # accept (an input_text is also an object with a string "type") violates.
    type: str = Field(json_schema_extra={"not": {"enum": list(_KNOWN_PART_TYPES)}})


def _part_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in _KNOWN_PART_TYPES else "other"


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputTextParam, Tag("output_text")]
    | Annotated[RefusalParam, Tag("refusal")] | Annotated[InputImage, Tag("input_image")]
    | Annotated[UnsupportedPart, Tag("other")],
    Discriminator(_part_kind),
]


class MessageItem(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(WireModel):
    type: str = "reasoning_text"
    text: str


class ReasoningItem(WireModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


_KNOWN_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class OtherItem(WireModel):
    """Any other item type (``item_reference``, hosted-tool calls): refused with a 400 naming it."""

    model_config = ConfigDict(extra="allow", strict=True)
    # Published as "any type but the four above": the union is a oneOf, which an item that two branches' schemas
    # accept (a function_call_output is also an object with a string "type") violates (schemathesis, CI57).
    type: str = Field(json_schema_extra={"not": {"enum": list(_KNOWN_ITEM_TYPES)}})


def _item_kind(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return kind if kind in _KNOWN_ITEM_TYPES else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


# ----------------------------------------------------------------------------- tools, options


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(WireModel):
    model_config = ConfigDict(extra="allow", strict=True)
    # Published as "any type but function", for the same reason as OtherItem's.
    type: str = Field(json_schema_extra={"not": {"enum": ["function"]}})


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "function" if kind == "function" else "hosted"


ToolParam = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_kind),
]


class FunctionToolChoice(WireModel):
    type: Literal["function"]
    name: str


class TextFormat(WireModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(WireModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(WireModel):
    model: str
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = Field(None, description="accepted; the model's reasoning parser decides")


# ----------------------------------------------------------------------------- response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
