"""The tiny model is a real HF checkpoint, deterministic from its seed, with a Qwen chat template."""

from __future__ import annotations

import hashlib
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_server.models.tiny import TinyModelSpec, build_tiny_model


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_build_is_deterministic(tmp_path: Path) -> None:
    small = TinyModelSpec(seed=3, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    a = build_tiny_model(tmp_path / "a", small)
    b = build_tiny_model(tmp_path / "b", small)
    assert _digest(a) == _digest(b)
    c = build_tiny_model(tmp_path / "c", small.model_copy(update={"seed": 4}))
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_loads_with_auto_classes_and_renders_tools(tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.model_type == "qwen3"
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
    assert model.config.vocab_size >= len(tok)
    assert tok.eos_token == "<|im_end|>"
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    msgs = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}]},
        {"role": "tool", "content": "5"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in text and "<tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    # Markup tokens are single ids and survive decoding (tool parsers need them).
    ids = tok("<tool_call>\n{}</tool_call>", add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    assert tok.decode(ids) == "<tool_call>\n{}</tool_call>"
