"""The renderer over the real tiny tokenizer and its Qwen-style chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slime_server.gateway.chat_template import (
    ChatRenderer,
    ChatTemplateError,
    PrefixMismatchError,
    normalize_messages,
)
from tests._sessions_helpers import TOOLS, assistant_text


@pytest.fixture(scope="module")
def renderer(tiny_model_path: Path) -> ChatRenderer:
    return ChatRenderer(tiny_model_path)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    {"role": "assistant", "content": "It is 21C."},
    {"role": "user", "content": "Thanks"},
]


def test_render_matches_the_tokenizers_own_template(renderer: ChatRenderer, tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    plain = json.loads(json.dumps(CONVERSATION))
    plain[1]["content"] = "Weather in Paris?"
    expected = tok.apply_chat_template(plain, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    text = renderer.render_text(CONVERSATION, TOOLS)
    assert text == expected
    # The model's exact argument text is kept (no re-serialisation to '{"city": "Paris"}').
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = renderer.render_ids(CONVERSATION, TOOLS)
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert renderer.decode(ids) == text


def test_normalisation(renderer: ChatRenderer) -> None:
    msgs = normalize_messages([
        {"role": "developer", "content": "sys"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "ok"}]},
    ])
    assert msgs[0].role == "system"
    assert (msgs[1].content, msgs[1].reasoning_content, msgs[1].tool_calls[0].arguments) == ("", "hmm", '{"x": 1}')
    assert (msgs[2].content, msgs[2].tool_call_id) == ("ok", "c")
    assert renderer.render_text([{"role": "user", "content": "q"}, msgs[1]], add_generation_prompt=False) == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n" + assistant_text(
            "", [("f", '{"x": 1}')], reasoning="hmm") + "<|im_end|>\n")


@pytest.mark.parametrize("bad", [
    [],
    [{"role": "wizard", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    [{"role": "user", "content": 5}],
    [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
    ["not an object"],
])
def test_bad_messages_raise_a_typed_400(renderer: ChatRenderer, bad: list) -> None:
    with pytest.raises(ChatTemplateError) as exc:
        renderer.render_ids(bad)
    assert exc.value.status_code == 400


def test_suffix_concatenates_exactly(renderer: ChatRenderer) -> None:
    for cut in (3, 5):  # after an assistant tool call / after an assistant answer
        prefix = CONVERSATION[:cut]
        assert prefix[-1]["role"] == "assistant"
        suffix_text = renderer.suffix_text(prefix, CONVERSATION, TOOLS)
        assert suffix_text.startswith("\n<|im_start|>")  # cut right after the assistant's <|im_end|>
        prefix_ids = renderer.render_ids(prefix, TOOLS, add_generation_prompt=False)[:-1]  # minus the "\n"
        assert prefix_ids[-1] == renderer.eos_token_id
        assert prefix_ids + renderer.encode_suffix(prefix, CONVERSATION, TOOLS) == renderer.render_ids(
            CONVERSATION, TOOLS)


def test_suffix_strict_and_structural(renderer: ChatRenderer) -> None:
    prefix = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "r"}]
    full = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3?"}]
    with pytest.raises(PrefixMismatchError):
        renderer.suffix_text(prefix, full)  # the think block is not re-rendered: not a text prefix
    assert renderer.suffix_text(prefix, full, strict=False) == (
        "\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n")
    other_structure = [{"role": "system", "content": "s"}] + full
    with pytest.raises(PrefixMismatchError):
        renderer.suffix_text(prefix, other_structure[:2], strict=False)
    with pytest.raises(PrefixMismatchError):
        renderer.suffix_text(prefix, prefix[:1])


def test_token_facts(renderer: ChatRenderer) -> None:
    assert renderer.tokenizer.convert_ids_to_tokens(renderer.eos_token_id) == "<|im_end|>"
    assert renderer.eos_token_id in renderer.stop_token_ids
    assert renderer.context_length == 4096


PLAIN_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def toolless_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer with a ChatML template that ignores ``tools`` (as SmolLM2's and many base models')."""
    import shutil

    out = tmp_path_factory.mktemp("toolless")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_path / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = PLAIN_CHATML
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def test_a_template_that_shows_tools_is_told_apart_from_one_that_ignores_them(
        renderer: ChatRenderer, toolless_model: Path) -> None:
    assert renderer.template_renders_tools
    assert not ChatRenderer(toolless_model).template_renders_tools


def test_tools_a_template_ignores_go_into_the_system_prompt(toolless_model: Path) -> None:
    r = ChatRenderer(toolless_model)
    text = r.render_text(CONVERSATION, tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    for tool in TOOLS:  # every schema, verbatim, inside <tools>
        assert json.dumps(tool, ensure_ascii=False) in system.split("<tools>\n")[1].split("\n</tools>")[0]
    # the earlier call and its result are shown as the Hermes format the parser reads
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>' \
        "<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>" in text
    assert r.render_text(CONVERSATION) != text  # without tools nothing is added
    assert "# Tools" not in r.render_text(CONVERSATION)


def test_tools_a_template_ignores_are_refused_when_the_fallback_is_off(toolless_model: Path) -> None:
    from slime_server.gateway.chat_template import ToolsNotSupportedError

    r = ChatRenderer(toolless_model, tools_fallback="error")
    with pytest.raises(ToolsNotSupportedError, match="ignores tools") as info:
        r.render_text(CONVERSATION, tools=TOOLS)
    assert (info.value.status_code, info.value.code, info.value.param) == (400, "tools_not_supported", "tools")
    r.render_text(CONVERSATION)  # no tools: fine


def test_every_eos_of_the_generation_config_closes_a_turn(toolless_model: Path) -> None:
    (toolless_model / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    try:
        r = ChatRenderer(toolless_model)
        assert {5, 7, r.eos_token_id} <= set(r.stop_token_ids)
    finally:
        (toolless_model / "generation_config.json").unlink()
