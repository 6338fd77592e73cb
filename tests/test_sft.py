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
