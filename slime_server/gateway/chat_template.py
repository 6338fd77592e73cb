"""Chat rendering with the served model's own HF tokenizer: OpenAI messages -> text -> token ids.

Why: the gateway sends token ids, never text, to the engines (ARCHITECTURE decision 2), so the
prompt must be rendered exactly as the model was trained to see it, and multi-turn assembly
(decision 3) needs the ids of *only the new part* of a conversation so that earlier tokens,
including the model's own sampled ids, are reused verbatim. Normalisation gives one canonical
message shape that the template and the session matcher both use.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from slime_server.buffer.schema import MessageImage, NormalizedMessage, ToolCallRef
from slime_server.gateway.images import IMAGE_PLACEHOLDER, VisionSpec
from slime_server.gateway.token_pieces import PieceEncoder, special_alternatives
from slime_server.gateway.token_text import TokenBytes


class ChatTemplateError(ValueError):
    """A request the renderer cannot turn into a prompt (the gateway answers 400)."""

    status_code = 400
    code = "invalid_messages"
    param = "messages"


class ToolsNotSupportedError(ChatTemplateError):
    """Tools sent to a model whose chat template ignores them, with the system-prompt fallback off."""

    code = "tools_not_supported"
    param = "tools"


class PrefixMismatchError(ChatTemplateError):
    """The full rendering does not extend the prefix rendering, so a suffix cannot be cut safely."""


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _content_text(content: Any, where: str, images: list[MessageImage] | None = None) -> str:
    """OpenAI ``content``: a string, null, or a list of text parts and canonical image parts (gateway/images.py:
    each becomes the model's placeholder in the text and a ``MessageImage`` in ``images``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if isinstance(part, dict) and part.get("type") == "image" and images is not None:
                images.append(MessageImage(sha256=part["sha256"], tokens=part["tokens"]))
                texts.append(IMAGE_PLACEHOLDER)
                continue
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"{where}.content[{i}]: unsupported content part type {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"{where}.content[{i}].text must be a string")
            texts.append(text)
        return "".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string, null or a list of parts")


def _tool_call(raw: Any, where: str) -> ToolCallRef:
    if not isinstance(raw, dict):
        raise ChatTemplateError(f"{where} must be an object")
    fn = raw.get("function", raw)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatTemplateError(f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments", "{}")
    if args is None:
        args = "{}"
    if not isinstance(args, str):
        # A client that sends a parsed object: serialise it the way the template's tojson would.
        args = json.dumps(args, ensure_ascii=False)
    call_id = raw.get("id")
    return ToolCallRef(id=call_id if isinstance(call_id, str) else None, name=fn["name"], arguments=args)


def normalize_message(raw: Any, index: int = 0) -> NormalizedMessage:
    """One OpenAI chat message (dict or pydantic model) -> the canonical shape."""
    where = f"messages[{index}]"
    if hasattr(raw, "model_dump"):
        raw = raw.model_dump(exclude_none=True)
    if not isinstance(raw, dict):
        raise ChatTemplateError(f"{where} must be an object")
    role = raw.get("role")
    if role not in _ROLES:
        raise ChatTemplateError(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}")
    if role == "developer":
        role = "system"
    images: list[MessageImage] = []
    content = _content_text(raw.get("content"), where, images if role in ("user", "tool") else None)
    msg = NormalizedMessage(role=role, content=content, images=images)
    if role == "assistant":
        reasoning = raw.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatTemplateError(f"{where}.reasoning_content must be a string")
        msg.reasoning_content = reasoning or None
        calls = raw.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ChatTemplateError(f"{where}.tool_calls must be a list")
        msg.tool_calls = [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    elif role == "tool":
        call_id = raw.get("tool_call_id")
        msg.tool_call_id = call_id if isinstance(call_id, str) else None
    name = raw.get("name")
    if isinstance(name, str) and role != "assistant":
        msg.name = name
    return msg


def normalize_messages(messages: list[Any]) -> list[NormalizedMessage]:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def _template_dict(msg: NormalizedMessage) -> dict[str, Any]:
    """The dict handed to the Jinja template (Qwen/HF conventions for tool calls)."""
    d: dict[str, Any] = {"role": msg.role, "content": msg.content}
    if msg.role == "assistant":
        if msg.reasoning_content:
            d["reasoning_content"] = msg.reasoning_content
        if msg.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in msg.tool_calls
            ]
    if msg.tool_call_id is not None:
        d["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        d["name"] = msg.name
    return d


TOOLS_FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_in_system_prompt(msgs: list[NormalizedMessage], tools: list[dict[str, Any]]) -> list[NormalizedMessage]:
    """The conversation as a template without tool support must see it (the documented fallback).

    Tool schemas go into the system prompt in the Hermes format (the default ``hermes`` parser reads the
    answer), earlier calls into their assistant turn's text as ``<tool_call>`` blocks, and tool results
    into user turns as ``<tool_response>`` blocks, as Qwen's and Hermes' templates render them.
    """
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = TOOLS_FALLBACK_PROMPT.format(tools=listing)
    out: list[NormalizedMessage] = []
    if msgs[0].role == "system":
        out.append(msgs[0].model_copy(update={"content": f"{msgs[0].content}\n\n{prompt}" if msgs[0].content
                                              else prompt}))
        rest = msgs[1:]
    else:
        out.append(NormalizedMessage(role="system", content=prompt))
        rest = msgs
    for m in rest:
        if m.role == "assistant" and m.tool_calls:
            blocks = [f'<tool_call>\n{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}'
                      "\n</tool_call>" for c in m.tool_calls]
            text = "\n".join([m.content, *blocks] if m.content else blocks)
            out.append(m.model_copy(update={"content": text, "tool_calls": []}))
        elif m.role == "tool":
            out.append(NormalizedMessage(role="user", content=f"<tool_response>\n{m.content}\n</tool_response>",
                                         images=m.images))
        else:
            out.append(m)
    return out


def _template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError("tools must be a list of objects")
    return tools


class ChatRenderer:
    """Renders OpenAI conversations to prompt ids with a model's HF tokenizer and chat template."""

    def __init__(self, tokenizer_path: str | Path, *, context_length: int | None = None,
                 tools_fallback: str = "system_prompt") -> None:
        if tools_fallback not in ("system_prompt", "error"):
            raise ValueError(f"tools_fallback must be 'system_prompt' or 'error', got {tools_fallback!r}")
        self.tools_fallback = tools_fallback
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(f"tokenizer at {tokenizer_path} has no chat template")
        self.context_length = context_length or self._read_context_length(Path(tokenizer_path))
        special_ids = {t.content: int(i) for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        alternatives = special_alternatives(special_ids)
        self._special_re = re.compile(alternatives)
        self._special_split_re = re.compile(f"({alternatives})")
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ChatTemplateError("tokenizer has no eos token")
        self.eos_token_id: int = int(eos)
        stops = {self.eos_token_id}
        for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid is not None:
                stops.add(tid)
        stops |= self._generation_config_eos(Path(tokenizer_path))
        self.stop_token_ids: list[int] = sorted(stops)
        self.token_bytes = TokenBytes(self.tokenizer)  # each id's own bytes (logprobs, split characters)
        self.template_renders_tools = self._renders_tools()
        self.vision = VisionSpec.of(tokenizer_path)  # a vision-language model's image rules (None: text only)
        self._pieces = PieceEncoder(self.tokenizer, special_ids, probes=self._probe_renderings())

    def _probe_renderings(self) -> list[str]:
        """This template's rendering of a short agent conversation, for ``PieceEncoder``'s check."""
        call = {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls -la"}'}}
        conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": " Hi,\n  there ✓"},
                        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\n\n b.txt "},
                        {"role": "assistant", "content": "Two files."}, {"role": "user", "content": "ok"}]
        try:
            return [self.render_text(conversation), self.render_text(conversation[:2])]
        except ChatTemplateError:  # a template that refuses this conversation: the built-in probes still run
            return []

    def _renders_tools(self) -> bool:
        """Whether the chat template shows ``tools`` to the model at all (many base ChatML ones do not)."""
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "probe_tool_fn", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            bare = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            shown = self.tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that refuses this probe: trust it with tools
            return True
        return bare != shown

    @staticmethod
    def _generation_config_eos(path: Path) -> set[int]:
        """``generation_config.json``'s EOS ids (Llama 3 lists three; the engines stop on every one)."""
        cfg = path / "generation_config.json"
        if not cfg.exists():
            return set()
        eos = json.loads(cfg.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        return {int(i) for i in ids if isinstance(i, int)}

    def _read_context_length(self, path: Path) -> int:
        cfg = path / "config.json"
        if cfg.exists():
            data = json.loads(cfg.read_text())
            for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
                if isinstance(data.get(key), int):
                    return int(data[key])
        limit = getattr(self.tokenizer, "model_max_length", None)
        return int(limit) if isinstance(limit, int) and limit < 10**9 else 32768

    def normalize(self, messages: list[Any]) -> list[NormalizedMessage]:
        return normalize_messages(messages)

    def render_text(self, messages: list[Any], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (raw dicts or normalised)."""
        msgs = [m if isinstance(m, NormalizedMessage) else normalize_message(m, i) for i, m in enumerate(messages)]
        if not msgs:
            raise ChatTemplateError("messages must be a non-empty list")
        if tools and not self.template_renders_tools:
            if self.tools_fallback == "error":
                raise ToolsNotSupportedError(
                    "this model's chat template ignores tools; the server's gateway.tools_fallback is 'error' "
                    "(set it to 'system_prompt' to describe the tools in the system prompt)")
            msgs, tools = tools_in_system_prompt(msgs, _template_tools(tools) or []), None
        try:
            text = self.tokenizer.apply_chat_template(
                [_template_dict(m) for m in msgs], tools=_template_tools(tools), tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja raise_exception / TemplateError for unsupported conversations
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError("chat template did not return text")
        return text

    def encode(self, text: str) -> list[int]:
        """Tokenize rendered text; special tokens in it are already literal, so add none. Piece by piece between
        special tokens, each piece tokenized once (``token_pieces``): a conversation's earlier turns are not
        tokenized again every turn."""
        return self._pieces.encode(text)

    def render_ids(self, messages: list[Any], tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_text(messages, tools, add_generation_prompt))

    def suffix_text(self, prefix_messages: list[Any], all_messages: list[Any],
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                    *, strict: bool = True) -> str:
        """Text the full rendering adds after the prefix's rendering, cut right after a special token.

        The prefix rendering (no generation prompt) is cut after its last special token, e.g. the
        ``<|im_end|>`` that closes its last assistant turn; what follows it there (the template's
        ``"\n"``) belongs to the suffix. Because special tokens are split off before BPE, the suffix
        tokenizes the same alone as inside the full text, so ``prefix ids + suffix ids`` is exact.

        ``strict`` requires the full text to start with the prefix text. With ``strict=False`` only
        the turn skeleton must agree up to the cut (the same special tokens, and between them either
        the same text or the same first line, i.e. the same role header), so the bodies of earlier
        turns may differ: templates that drop old ``<think>`` blocks, where the caller keeps its own
        exact ids for the prefix anyway. Raises ``PrefixMismatchError`` otherwise.
        """
        if len(all_messages) < len(prefix_messages):
            raise PrefixMismatchError("the conversation is shorter than the prefix")
        prefix_text = self.render_text(prefix_messages, tools, add_generation_prompt=False)
        full_text = self.render_text(all_messages, tools, add_generation_prompt=add_generation_prompt)
        pre = list(self._special_re.finditer(prefix_text))
        if not pre:
            raise PrefixMismatchError("the prefix rendering contains no special token to cut at")
        cut_pre = pre[-1].end()
        if strict:
            if not full_text.startswith(prefix_text):
                raise PrefixMismatchError("the full rendering does not start with the prefix rendering")
            return full_text[cut_pre:]
        full = list(self._special_re.finditer(full_text))
        if len(full) < len(pre):
            raise PrefixMismatchError("the full rendering has fewer turns than the prefix")
        cut_full = full[len(pre) - 1].end()
        ours, theirs = self._chunks(prefix_text[:cut_pre]), self._chunks(full_text[:cut_full])
        for a, b in zip(ours, theirs, strict=True):
            # Same special tokens, and each turn keeps its header line (its role); only bodies may differ.
            if a != b and a.split("\n", 1)[0] != b.split("\n", 1)[0]:
                raise PrefixMismatchError("the full rendering does not share the prefix's turn structure")
        if not full_text[cut_full:].startswith(prefix_text[cut_pre:]):
            raise PrefixMismatchError("the full rendering does not continue the prefix's last turn")
        return full_text[cut_full:]

    def _chunks(self, text: str) -> list[str]:
        """Special tokens and the text between them, alternating (split keeps the separators)."""
        return self._special_split_re.split(text)

    def encode_suffix(self, prefix_messages: list[Any], all_messages: list[Any],
                      tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                      *, strict: bool = True) -> list[int]:
        """Ids of :meth:`suffix_text`: what to append after the exact ids of the prefix."""
        return self.encode(self.suffix_text(prefix_messages, all_messages, tools, add_generation_prompt,
                                            strict=strict))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
