"""Pydantic models of the Anthropic Messages wire format (``POST /v1/messages``, ``count_tokens``).

Field names and shapes follow the Anthropic API reference (2023-06-01 version header). Requests
ignore unknown fields (``cache_control``, ``citations``, beta fields such as ``context_management``):
they change nothing this server does. Content the served model cannot take (images, documents) is
a 400 naming the block, never silently dropped.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slime_server.gateway.protocol import WireModel

MAX_STOP_SEQUENCES = 16


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------------------- request content blocks


class TextBlockParam(WireModel):
    type: Literal["text"]
    text: str


class ImageBlockParam(WireModel):
    type: Literal["image"]
    source: dict[str, Any] = Field(default_factory=dict)


class DocumentBlockParam(WireModel):
    type: Literal["document"]
    source: dict[str, Any] = Field(default_factory=dict)


class ToolUseBlockParam(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlockParam(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlockParam | ImageBlockParam | DocumentBlockParam,
                                  Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlockParam(WireModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(WireModel):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlockParam = Annotated[
    TextBlockParam | ImageBlockParam | DocumentBlockParam | ToolUseBlockParam | ToolResultBlockParam
    | ThinkingBlockParam | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(WireModel):
    """One input message. ``system`` entries inside ``messages`` are accepted (Claude Code sends them)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class ToolParam(WireModel):
    """A client tool (``input_schema``); Anthropic's server tools (``web_search_…``, ``bash_…``) have a
    ``type`` and no schema: this server cannot run them, so they are not offered to the model."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceParam(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JSONOutputFormat(WireModel):
    """Structured outputs: the answer's text is JSON valid against ``schema`` (decoded under it)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(WireModel):
    effort: str | None = Field(None, description="accepted; this server's models have no effort setting")
    format: JSONOutputFormat | None = None


class MessagesRequest(WireModel):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlockParam] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(None, description="accepted; the model's reasoning parser decides")
    output_config: OutputConfig | None = None


class CountTokensRequest(WireModel):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


# ----------------------------------------------------------------------------- response


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
