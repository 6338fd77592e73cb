"""Training on turns decoded under a grammar (issue 42): the trainer rebuilds the engine's token masks from the
recorded grammar and scores those tokens under them, so its log-probs equal the recorded (masked) ones and an
importance ratio between the two is 1, where the unmasked policy is off by nats per token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slime_server.buffer.schema import Trajectory, Turn
from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
from slime_server.rollout.protocol import SamplingParams
from slime_server.trainer.grammar_masks import GrammarMasker
from slime_server.trainer.samples import to_train_sample

torch.set_num_threads(2)
PROMPT = [31, 32, 33, 34, 35]
SCHEMA = json.dumps({"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]},
                                                      "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                                      "stops": {"type": "array", "maxItems": 2,
                                                                "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}},
                     "required": ["city", "days", "stops"], "additionalProperties": False})


@pytest.fixture(scope="module")
def parallel_world() -> Iterator[None]:
    from slime_server.trainer.parallel import parallel_context

    with parallel_context(tp_size=1, seed=11):
        yield


@pytest.fixture(scope="module")
def recorded(tiny_model_path: Path) -> list[Trajectory]:
    """Trajectories as the gateway records constrained turns: the engine's tokens and (masked) log-probs, the
    grammar on the turn, loss mask 0 on its tokens; one JSON-schema turn per sample, and one regex turn."""
    engine = CPUEngine(EngineConfig(model_path=str(tiny_model_path)))
    try:
        runs = [("json_schema", SCHEMA, engine.generate(PROMPT, SamplingParams(
            temperature=1.0, max_new_tokens=200, n=3, sampling_seed=4, json_schema=SCHEMA), return_logprob=True)),
                ("regex", "(yes|no), [0-9]{3}", engine.generate(PROMPT, SamplingParams(
                    temperature=1.0, max_new_tokens=20, sampling_seed=2, regex="(yes|no), [0-9]{3}"),
                    return_logprob=True))]
    finally:
        engine.shutdown()
    out = []
    for key, text, outs in runs:
        for o in outs:
            assert o.meta_info.finish_reason.type == "stop"
            lps = [lp for lp, _, _ in o.meta_info.output_token_logprobs]
            n = len(o.output_ids)
            out.append(Trajectory(session_id="s", tokens=PROMPT + o.output_ids, loss_mask=[0] * (len(PROMPT) + n),
                                  rollout_logprobs=[0.0] * len(PROMPT) + lps, weight_versions=[-1] * len(PROMPT) + [0] * n,
                                  turns=[Turn(response_id="r", prompt_start=0, output_start=len(PROMPT),
                                              output_end=len(PROMPT) + n, grammar={key: text})]))
    return out


def _bundle(model_path: Path) -> object:
    from transformers import AutoConfig

    from slime_server.trainer.convert import load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model
    from slime_server.trainer.optimizer import build_optimizer
    from slime_server.trainer.settings import OptimizerSettings

    model = build_gpt_model(AutoConfig.from_pretrained(model_path))
    load_hf_checkpoint_into(model, model_path)
    return build_optimizer(model, OptimizerSettings(lr=1e-4))


def test_the_trainers_logprobs_are_the_recorded_masked_ones(parallel_world: None, tiny_model_path: Path,
                                                            recorded: list[Trajectory]) -> None:
    from slime_server.trainer.train_step import compute_logprobs

    masker = GrammarMasker(tiny_model_path)
    samples = [to_train_sample(t, masker) for t in recorded]
    bare = [to_train_sample(t) for t in recorded]  # no masker: the turns stay out of the loss, unscored
    bundle = _bundle(tiny_model_path)
    for t, s, b in zip(recorded, samples, bare, strict=True):
        span = range(t.turns[0].output_start, t.turns[0].output_end)
        assert s.grammar_positions == list(span) and all(s.loss_mask[p] == 1 for p in span)
        assert b.grammar_positions is None and sum(b.loss_mask) == 0
    packed = compute_logprobs(bundle.model, samples, max_tokens_per_micro_batch=4096)  # all in one micro-batch
    alone = [compute_logprobs(bundle.model, [s], max_tokens_per_micro_batch=4096)[0] for s in samples]
    unmasked = compute_logprobs(bundle.model, [s.model_copy(update={"grammar_positions": None,
                                                                    "grammar_bitmask": None}) for s in samples])
    gaps = []
    for t, lp, one, free in zip(recorded, packed, alone, unmasked, strict=True):
        span = slice(t.turns[0].output_start, t.turns[0].output_end)
        ours, theirs = lp[span], torch.tensor(t.rollout_logprobs[span])
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)  # TIS's ratio exp(ours - theirs) is 1
        torch.testing.assert_close(one[span], ours, atol=1e-6, rtol=0)  # packing does not mix the masks
        gaps.append(float((ours - free[span]).mean()))
    assert min(gaps) > 0.5, gaps  # without the masks the ratio would be off by this much a token (nats)


def test_a_step_trains_on_constrained_turns(parallel_world: None, tiny_model_path: Path,
                                            recorded: list[Trajectory]) -> None:
    from slime_server.trainer.settings import LossConfig
    from slime_server.trainer.train_step import TrainStepSettings, compute_logprobs, forward_backward

    masker = GrammarMasker(tiny_model_path)
    samples = [to_train_sample(t.model_copy(update={"reward": float(i % 2)}), masker)
               for i, t in enumerate(recorded)]
    for s in samples:
        s.advantages = [(1.0 if s.reward > 0 else -1.0) * m for m in s.loss_mask]
    bundle = _bundle(tiny_model_path)
    before = compute_logprobs(bundle.model, samples)
    metrics = forward_backward(bundle, samples, TrainStepSettings(loss=LossConfig(loss_type="grpo", use_tis=True)),
                               old_logprobs=before)
    assert metrics["loss"] == metrics["loss"] and metrics["loss_tokens"] == sum(sum(s.loss_mask) for s in samples) > 0
    grads = [p.main_grad for p in bundle.model.module.parameters() if p.main_grad is not None]
    assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)


def test_a_grammar_that_does_not_fit_the_tokens_keeps_them_out(tiny_model_path: Path,
                                                                recorded: list[Trajectory]) -> None:
    t = recorded[-1]  # the regex turn, recorded under another grammar than the one it names now
    wrong = t.model_copy(update={"turns": [t.turns[0].model_copy(update={"grammar": {"regex": "[0-9]+"}})]})
    s = to_train_sample(wrong, GrammarMasker(tiny_model_path))
    assert s.grammar_positions is None and sum(s.loss_mask) == 0


def test_a_vocab_shard_reads_its_own_columns_of_the_bitmask() -> None:
    """Under tensor parallelism each rank masks its own slice of the vocabulary; padding columns are never
    allowed."""
    import numpy as np

    from slime_server.trainer.grammar_masks import allowed_columns

    vocab, rows = 100, 3
    gen = np.random.default_rng(0)
    allowed = gen.random((rows, vocab)) < 0.3
    words = np.zeros((rows, (vocab + 31) // 32), dtype=np.uint32)
    for r, v in zip(*np.nonzero(allowed), strict=True):
        words[r, v // 32] |= np.uint32(1 << (v % 32))
    bitmask = words.astype("<u4").view("<i4").tobytes()
    width = 52  # two ranks of 52 columns: 104 >= 100, the last 4 are padding
    for rank in (0, 1):
        got = allowed_columns(bitmask, rows, rank * width, width, vocab).numpy()
        want = np.zeros((rows, width), dtype=bool)
        real = min(vocab, (rank + 1) * width) - rank * width
        want[:, :real] = allowed[:, rank * width: rank * width + real]
        assert (got == want).all()
