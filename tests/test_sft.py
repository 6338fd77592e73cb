"""SFT through the Megatron trainer: the loss mask covers exactly what the policy generates, and a
few steps on real conversations lower their NLL in the exported HF checkpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_server.demo_learning import demo_rows, sloppy_teacher_conversation
from slime_server.envs.calculator import CalculatorEnv, evaluate
from slime_server.trainer.sft import SFTSettings, conversation_sample, run_sft


def test_sloppy_teacher_keeps_numbers_and_format_but_not_the_operator() -> None:
    rng = random.Random(0)
    ops = set()
    for row in demo_rows(60, seed=1):
        conv = sloppy_teacher_conversation(row, rng)
        call = conv[-3]["tool_calls"][0]["function"]
        a, op, b = json.loads(call["arguments"])["expression"].split()
        ra, _, rb = row.metadata["expression"].split()
        assert (a, b) == (ra, rb)
        ops.add(op)
        assert conv[-2]["content"] == str(int(evaluate(f"{a} {op} {b}")))
        assert conv[-1]["content"] == f"The answer is {conv[-2]['content']}."
    assert ops == {"+", "-", "*"}


def test_conversation_sample_masks_exactly_the_assistant_turns(tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    env = CalculatorEnv()
    row = demo_rows(1, seed=3)[0]
    conv = sloppy_teacher_conversation(row, random.Random(0))
    s = conversation_sample(tok, conv, env.tools())
    whole = tok.apply_chat_template(conv, tools=env.tools(), tokenize=False)
    assert s.tokens == tok.encode(whole, add_special_tokens=False)
    runs, cur = [], []
    for t, m in zip(s.tokens, s.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    expr = json.loads(conv[-3]["tool_calls"][0]["function"]["arguments"])["expression"]
    assert runs == [f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call><|im_end|>',
                    f"{conv[-1]['content']}<|im_end|>"]


def _nll(model_dir: Path, samples) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
            total += float(-lp[mask].sum())
            n += int(mask.sum())
    return total / n


@pytest.mark.timeout(300)
def test_run_sft_lowers_the_nll_of_its_data_and_exports_a_loadable_checkpoint(tiny_model_path: Path,
                                                                               tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rng = random.Random(0)
    samples = [conversation_sample(tok, sloppy_teacher_conversation(r, rng), CalculatorEnv().tools())
               for r in demo_rows(8, seed=5)]
    losses: list[float] = []
    out = run_sft(tiny_model_path, samples, SFTSettings(steps=6, batch_size=4, lr=1e-3, warmup_steps=0),
                  tmp_path / "sft", on_step=lambda step, m: losses.append(m["loss"]))
    assert len(losses) == 6
    before, after = _nll(tiny_model_path, samples), _nll(out, samples)
    assert after < before - 1.0, (before, after)
    assert json.loads((out / "slime_sft.json").read_text())["steps"] == 6
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template


@pytest.mark.timeout(300)
def test_sft_on_conversations_with_images_trains_the_language_model_and_keeps_the_tower(tmp_path: Path) -> None:
    """Issue 45: a conversation with an image (a tool's picture, shown in a user turn) becomes a sample whose image
    pads are expanded as the engine expands them (mask 0) and which carries the picture; SFT on such samples writes
    a vision-language checkpoint whose language model changed, whose vision tower is the base's, and which the engine
    serves with images."""
    import base64

    from safetensors.torch import load_file

    from slime_server.envs.shapes import ShapesEnv, render
    from slime_server.gateway.images import VisionSpec
    from slime_server.models.tiny_vl import ensure_tiny_vl_model
    from slime_server.rollout.cpu_engine import CPUEngine
    from slime_server.rollout.engine_config import EngineConfig
    from slime_server.rollout.protocol import SamplingParams

    base = ensure_tiny_vl_model()
    tok, spec, env = AutoTokenizer.from_pretrained(base), VisionSpec(base), ShapesEnv()
    samples = []
    for row in env.default_dataset(6, seed=4):
        picture = render(row.metadata["colour"], row.metadata["shape"], row.metadata["seed"])
        call = {"id": "c", "type": "function", "function": {"name": "look", "arguments": "{}"}}
        conversation = [*env.reset(row).messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c", "content": "Here is the picture."},
                        {"role": "user", "content": [{"type": "image", "image": picture}]},
                        {"role": "assistant", "content": f"<answer>{row.label}</answer>"}]
        samples.append(conversation_sample(tok, conversation, env.tools(), vision=spec))
    s = samples[0]
    (image,) = s.images
    assert image.length == spec.tokens(112, 112) == 16 and image.data.startswith(b"\x89PNG")
    pads = s.tokens[image.offset:image.offset + image.length]
    assert pads == [spec.pad_id] * 16 and s.tokens.count(spec.pad_id) == 16
    assert not any(s.loss_mask[image.offset:image.offset + image.length]) and sum(s.loss_mask) > 0
    out = run_sft(base, samples, SFTSettings(steps=3, batch_size=3, lr=1e-3, warmup_steps=0), tmp_path / "sft")
    before, after = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("visual."))
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    engine = CPUEngine(EngineConfig(model_path=str(out), num_threads=1))
    try:
        prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False,
                                         add_generation_prompt=True)
        ids, mm = engine.prepare_images(tok(prompt, add_special_tokens=False)["input_ids"],
                                        ["data:image/png;base64," + base64.b64encode(image.data).decode()])
        assert engine.generate(ids, SamplingParams(max_new_tokens=2), images=mm)[0].meta_info.image_tokens == 16
    finally:
        engine.shutdown()
