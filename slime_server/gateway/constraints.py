"""What a request asks its answer to be, as the grammar SGLang's ``/generate`` takes (issue 42).

Why here: ``response_format`` (Chat), ``text.format`` (Responses) and a forced tool choice (``required`` or a named
function in Chat and Responses, ``any`` / ``tool`` in Messages, all three reaching this module as the Chat fields)
are promises about the answer. The engines keep them by constrained decoding (``sampling_params.json_schema`` or
``ebnf``, compiled by xgrammar on every engine: ``rollout/grammar.py`` on the CPU engine, SGLang's own
backend on GPU), so a framework that forces a tool gets a tool call and a structured-output agent gets JSON that
validates. An ``auto`` tool choice without a response format stays unconstrained.

A forced call is framed as the served model's tool-call parser reads it (``FRAMES``): the gateway prefills the
frame's opening (prompt tokens, never trained on) and the grammar makes the model write one of the allowed tools'
names, its arguments (valid against that tool's ``parameters``) and the frame's close; then only an end-of-turn
token is allowed. With a response format and tools under ``auto``, the answer is either such a call or the JSON.

Schemas are checked here first, so a schema the grammar would not enforce is a 400 naming its field (never a
promise silently dropped): the keywords xgrammar accepts but ignores, and strings bounded in length (xgrammar
0.2.7 lets raw control characters into those: the JSON would not parse), which are rewritten to an equivalent
``pattern`` that excludes them.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from slime_server.gateway.errors import bad_request
from slime_server.gateway.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCallParser,
)
from slime_server.rollout.grammar_errors import xgrammar_message

STRING_CHARS = r'^[^"\\\x00-\x1f\ud800-\udfff]'  # a JSON string's characters that need no escape (no surrogates)

# keywords xgrammar 0.2.7 accepts in a schema but does not enforce (as SGLang's json_schema_validation lists)
UNENFORCED_KEYWORDS = frozenset({
    "contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains", "minContains",
    "multipleOf", "not", "then", "uniqueItems",
})
_ONE = ("additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "items", "not",
        "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAPS = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")


@dataclass(frozen=True)
class CallFrame:
    """How one tool-call format writes a call: ``open`` + name + ``mid`` + arguments JSON + ``close``."""

    open: str
    mid: str
    close: str


FRAMES: dict[type[ToolCallParser], CallFrame] = {
    HermesToolParser: CallFrame('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
    Llama3JsonToolParser: CallFrame('{"name": "', '", "parameters": ', "}"),
    MistralToolParser: CallFrame('[TOOL_CALLS][{"name": "', '", "arguments": ', "}]"),
}


@dataclass
class Plan:
    """A turn's constraint: the text prefilled into the prompt, and the ``sampling_params`` grammar."""

    prefill: str = ""
    grammar: dict[str, str] | None = None


def enforceable(schema: Any, where: str) -> Any:
    """``schema`` as the grammar will enforce it (length-bounded strings as patterns), or a 400 naming ``where``
    for a keyword the grammar would ignore."""
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON Schema object", param=where)
    error = schema_error(json.dumps(schema, sort_keys=True))
    if error is not None:
        raise bad_request(f"{where} is not a valid JSON Schema: {error}", param=where)
    out = copy.deepcopy(schema)
    _rewrite(out, where)
    reason = _grammar_error(json.dumps(out, sort_keys=True))
    if reason is not None:  # what the engines' grammar library refuses is refused here, naming the field
        raise bad_request(f"{where} cannot be enforced: {reason}", param=where, code="unsupported_parameter")
    return out


@functools.lru_cache(maxsize=512)
def _grammar_error(schema: str) -> str | None:
    """Why xgrammar (the engines' grammar library) cannot build a grammar of this schema; None: it can."""
    import xgrammar as xgr  # ~0.8 s to import: paid by the first constrained call

    try:
        xgr.Grammar.from_json_schema(schema)
    except (RuntimeError, ValueError, TypeError) as e:
        return xgrammar_message(e)
    return None


@functools.lru_cache(maxsize=512)
def schema_error(schema_json: str) -> str | None:
    """Why a schema (a tool's parameters, a response format's) is not a JSON Schema (None: it is), by its canonical
    JSON text. Cached: an agent sends the same schemas on every turn, and checking one against its metaschema took
    0.33 ms (the calculator's one tool; the gateway spends ~2.8 ms of CPU on a whole request)."""
    schema = json.loads(schema_json)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return e.message
    return None


def _rewrite(schema: dict[str, Any], where: str) -> None:
    bad = sorted(UNENFORCED_KEYWORDS & schema.keys())
    if bad:
        raise bad_request(f"{where}: the JSON Schema keyword {bad[0]!r} cannot be enforced by constrained decoding",
                          param=where, code="unsupported_parameter")
    if (schema.get("type") == "string" and ("minLength" in schema or "maxLength" in schema)
            and not {"pattern", "format", "enum", "const"} & schema.keys()):
        lo, hi = int(schema.pop("minLength", 0)), schema.pop("maxLength", None)
        schema["pattern"] = STRING_CHARS + "{" + f"{lo},{'' if hi is None else int(hi)}" + "}$"
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            _rewrite(schema[key], f"{where}.{key}")
    for key in _LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            if isinstance(sub, dict):
                _rewrite(sub, f"{where}.{key}[{i}]")
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if isinstance(sub, dict):
                    _rewrite(sub, f"{where}.{key}.{name}")


def response_schema(fmt: Any) -> Any:
    """The JSON schema a Chat ``response_format`` promises (``ANY_JSON`` for json_object); None for text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}  # a JSON object, as OpenAI promises it (and SGLang's OpenAI routes send)
    if fmt.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema is required for a json_schema response format",
                          param="response_format.json_schema.schema")
    return enforceable(fmt.json_schema.schema_, "response_format.json_schema.schema")


def _call_element(frame: CallFrame, name: str, parameters: Any, where: str, *, with_open: bool) -> dict[str, Any]:
    schema = enforceable(parameters if parameters is not None else {"type": "object"}, where)
    head = (frame.open if with_open else "") + name + frame.mid
    return {"type": "sequence", "elements": [{"type": "const_string", "value": head},
                                             {"type": "json_schema", "json_schema": schema},
                                             {"type": "const_string", "value": frame.close}]}


def plan(parser: ToolCallParser, tools: list[Any] | None, tool_choice: Any, response_format: Any) -> Plan:
    """The constraint of a Chat request (its fields already validated against each other)."""
    answer = response_schema(response_format)
    tools = tools or []
    forced = tool_choice == "required" or (tool_choice is not None and not isinstance(tool_choice, str))
    if not forced and (answer is None or not tools or tool_choice == "none"):
        return Plan(grammar=None if answer is None else {"json_schema": json.dumps(answer)})
    frame = FRAMES.get(type(parser))
    if frame is None:
        raise bad_request(f"tool_choice cannot be enforced for this model's tool-call format "
                          f"({type(parser).__name__})", param="tool_choice", code="unsupported_parameter")
    allowed = [t for t in tools if tool_choice == "required" or not forced or t.function.name == _name(tool_choice)]
    elements = [_call_element(frame, t.function.name, t.function.parameters,
                              f"tools[{tools.index(t)}].function.parameters", with_open=not forced)
                for t in allowed]
    if not forced:  # auto with a response format: a call, or the answer in that format
        elements.append({"type": "json_schema", "json_schema": answer})
    tag = {"type": "structural_tag", "format": elements[0] if len(elements) == 1 else
           {"type": "or", "elements": elements}}
    return Plan(prefill=frame.open if forced else "", grammar={"ebnf": tag_ebnf(json.dumps(tag, sort_keys=True))})


@functools.lru_cache(maxsize=256)  # agents send the same tools every turn
def tag_ebnf(tag: str) -> str:
    """A structural tag as the EBNF grammar it stands for (xgrammar's own translation). Why not send the tag:
    sgl-router 0.3.2 drops ``sampling_params.structural_tag`` on its way to the engines (it forwards
    ``json_schema``, ``regex`` and ``ebnf``), so the engines would decode unconstrained."""
    import xgrammar as xgr  # ~0.8 s to import: paid by the first constrained call

    try:
        return str(xgr.Grammar.from_structural_tag(tag))
    except (RuntimeError, ValueError, TypeError) as e:
        raise bad_request(f"tools: the forced tool call's grammar cannot be built: {xgrammar_message(e)}",
                          param="tools") from None


def _name(choice: Any) -> str:
    return choice.function.name
