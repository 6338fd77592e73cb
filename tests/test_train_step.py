"""The Megatron-core training step on the tiny Qwen3 model (world size 1, gloo, CPU).

- per-token log-probs match an independent Hugging Face forward of the same checkpoint;
- packed micro-batches give the same loss and the same gradients as one sample per micro-batch;
- one GRPO step raises the log-prob of the rewarded response and lowers the other's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._trainer_helpers import make_batch

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def parallel_world() -> Iterator[None]:
    from slime_server.trainer.parallel import parallel_context

    with parallel_context(tp_size=1, seed=11):
        yield


def _bundle(model_path: Path, lr: float = 1e-3, clip_grad: float = 0.0) -> object:
    from transformers import AutoConfig

    from slime_server.trainer.convert import load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model
    from slime_server.trainer.optimizer import build_optimizer
    from slime_server.trainer.settings import OptimizerSettings

    model = build_gpt_model(AutoConfig.from_pretrained(model_path))
    load_hf_checkpoint_into(model, model_path)
    return build_optimizer(model, OptimizerSettings(lr=lr, clip_grad=clip_grad))


def _grads(bundle: object) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in bundle.model.module.named_parameters()}


def test_logprobs_match_huggingface(parallel_world: None, tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from slime_server.trainer.train_step import compute_logprobs

    bundle = _bundle(tiny_model_path)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    samples = make_batch(vocab_size=hf.config.vocab_size, n=3, seed=2)
    temperature = 0.7
    ours = compute_logprobs(bundle.model, samples, temperature=temperature, max_tokens_per_micro_batch=200)
    for sample, lp in zip(samples, ours, strict=True):
        ids = torch.tensor([sample.tokens])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0].float() / temperature
        expected = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        assert lp.shape == (len(sample.tokens),)
        assert lp[0] == 0.0
        torch.testing.assert_close(lp[1:], expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_packed_equals_unpacked(parallel_world: None, tiny_model_path: Path, aggregation: str) -> None:
    from transformers import AutoConfig

    from slime_server.trainer.optimizer import zero_grads
    from slime_server.trainer.settings import LossConfig
    from slime_server.trainer.train_step import TrainStepSettings, compute_logprobs, forward_backward

    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    samples = make_batch(vocab_size=vocab, n=5, seed=4)
    loss_cfg = LossConfig(loss_type="grpo", aggregation=aggregation, use_tis=True, entropy_coef=0.01,
                          kl_coef=0.05)
    # Old / reference policies off the current one, so ratios differ from 1 and clipping and KL bite.
    gen = torch.Generator().manual_seed(0)
    bundle = _bundle(tiny_model_path)
    current = compute_logprobs(bundle.model, samples)
    old = [lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in current]
    ref = [lp + 0.1 * torch.randn(lp.shape, generator=gen) for lp in current]
    results = {}
    for name, budget in (("packed", 4096), ("unpacked", 1)):
        zero_grads(bundle)
        metrics = forward_backward(bundle, samples, TrainStepSettings(max_tokens_per_micro_batch=budget,
                                                                      loss=loss_cfg),
                                   old_logprobs=old, ref_logprobs=ref)
        results[name] = (metrics, _grads(bundle))
    (packed, g_packed), (unpacked, g_unpacked) = results["packed"], results["unpacked"]
    assert packed["micro_batches"] == 1 and unpacked["micro_batches"] == len(samples)
    assert 0 < packed["clip_fraction"] < 1 and packed["kl"] > 0 and packed["entropy"] > 0
    assert packed["loss"] == pytest.approx(unpacked["loss"], abs=1e-5, rel=0)
    assert any(g.abs().max() > 0 for g in g_packed.values())
    for name, g in g_packed.items():
        torch.testing.assert_close(g, g_unpacked[name], atol=1e-5, rtol=0, msg=name)


def test_grpo_step_moves_logprobs_towards_the_rewarded_answer(parallel_world: None, tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    from slime_server.trainer.advantages import grpo_advantages
    from slime_server.trainer.settings import LossConfig
    from slime_server.trainer.train_step import TrainStepSettings, compute_logprobs, train_step
    from slime_server.trainer.types import TrainSample

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=True,
                                          add_generation_prompt=True, return_dict=True)["input_ids"])
    answers = {"good": "The answer is 5.", "bad": "I think it is 7, maybe."}
    samples = []
    for name, text in answers.items():
        out = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        samples.append(TrainSample(
            tokens=prompt + out, loss_mask=[0] * len(prompt) + [1] * len(out),
            rollout_logprobs=[0.0] * (len(prompt) + len(out)), reward=1.0 if name == "good" else 0.0,
            group_id="q", weight_versions=[-1] * len(prompt) + [0] * len(out), sample_id=name,
        ))
    samples = grpo_advantages(samples)
    bundle = _bundle(tiny_model_path, lr=1e-3, clip_grad=1.0)
    settings = TrainStepSettings(loss=LossConfig(loss_type="grpo"))

    def response_logprob() -> list[float]:
        lps = compute_logprobs(bundle.model, samples)
        return [float((lp * torch.tensor(s.loss_mask)).sum()) for s, lp in zip(samples, lps, strict=True)]

    before = response_logprob()
    metrics = train_step(bundle, samples, settings)
    after = response_logprob()
    assert metrics["step_skipped"] == 0.0 and metrics["grad_norm"] > 0
    assert after[0] > before[0], (before, after)
    assert after[1] < before[1], (before, after)


def test_optimizer_reads_megatron_main_grad(parallel_world: None, tiny_model_path: Path) -> None:
    """Megatron DDP leaves ``param.grad`` empty; the optimizer must see (and clip) ``main_grad``."""
    from transformers import AutoConfig

    from slime_server.trainer.optimizer import optimizer_step, zero_grads
    from slime_server.trainer.train_step import TrainStepSettings, forward_backward

    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    bundle = _bundle(tiny_model_path, lr=1e-3, clip_grad=0.5)
    before = {n: p.detach().clone() for n, p in bundle.model.module.named_parameters()}
    zero_grads(bundle)
    forward_backward(bundle, make_batch(vocab_size=vocab, n=3, seed=8), TrainStepSettings())
    grads = _grads(bundle)
    assert all(p.grad is None for p in bundle.model.module.parameters())
    expected_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    result = optimizer_step(bundle)
    assert result.updated and result.lr == pytest.approx(1e-3)
    assert result.grad_norm == pytest.approx(expected_norm, rel=1e-5)
    moved = [n for n, p in bundle.model.module.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)


def test_bad_settings_and_batches_are_rejected(parallel_world: None, tiny_model_path: Path) -> None:
    from pydantic import ValidationError

    from slime_server.trainer.settings import OptimizerSettings
    from slime_server.trainer.train_step import TrainStepSettings, train_step

    with pytest.raises(ValidationError):
        OptimizerSettings(lr=1e-3, lr_decay_style="cosine")  # cosine needs a decay horizon
    with pytest.raises(ValidationError):
        OptimizerSettings(lr=1e-3, lr_warmup_steps=10, lr_decay_steps=5)
    with pytest.raises(ValidationError):
        TrainStepSettings(temperature=0.0)
    with pytest.raises(ValueError, match="at least one sample"):
        train_step(_bundle(tiny_model_path), [], TrainStepSettings())


@pytest.mark.parametrize("budget", [4096, 48])
def test_shared_prefixes_train_as_separate_rows(parallel_world: None, tiny_model_path: Path, budget: int) -> None:
    """The token tree (each shared prefix computed once) gives the loss, metrics, gradients and log-probs of
    the plain packed rows: one micro-batch holding every sample, and a budget that cuts the groups apart."""
    from transformers import AutoConfig

    from slime_server.trainer.optimizer import zero_grads
    from slime_server.trainer.packing import pack_samples
    from slime_server.trainer.prefix_tree import tree_rows
    from slime_server.trainer.settings import LossConfig
    from slime_server.trainer.train_step import TrainStepSettings, compute_logprobs, forward_backward

    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    samples = make_batch(vocab_size=vocab, n=6, seed=5, shared=True)
    samples.append(samples[1].model_copy())  # a duplicate: no row of its own
    mbs = pack_samples(samples, budget, share_prefixes=True)
    assert sum(mb.tree is not None for mb in mbs) >= (1 if budget == 4096 else 2)
    if budget == 4096:  # the system prompt once, each group's prompt once, the duplicate nowhere
        rows = sum(len(s.tokens) for s in samples[:-1]) - 4 * 5 - sum(s.loss_mask.count(0) - 4 for s in samples[1:6:2])
        assert mbs[0].num_rows == tree_rows([s.tokens for s in samples]) == rows
    loss_cfg = LossConfig(loss_type="grpo", use_tis=True, entropy_coef=0.01, kl_coef=0.05)
    gen = torch.Generator().manual_seed(0)
    bundle = _bundle(tiny_model_path)
    plain = compute_logprobs(bundle.model, samples, max_tokens_per_micro_batch=budget, share_prefixes=False)
    shared = compute_logprobs(bundle.model, samples, max_tokens_per_micro_batch=budget, share_prefixes=True)
    for a, b in zip(plain, shared, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    old = [lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in plain]
    ref = [lp + 0.1 * torch.randn(lp.shape, generator=gen) for lp in plain]
    results = {}
    for share in (False, True):
        zero_grads(bundle)
        metrics = forward_backward(bundle, samples, TrainStepSettings(
            max_tokens_per_micro_batch=budget, loss=loss_cfg, share_prefixes=share), old_logprobs=old, ref_logprobs=ref)
        results[share] = (metrics, _grads(bundle))
    (m_plain, g_plain), (m_shared, g_shared) = results[False], results[True]
    assert 0 < m_shared["clip_fraction"] < 1 and m_shared["kl"] > 0
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_fraction"):
        assert m_shared[key] == pytest.approx(m_plain[key], abs=1e-5, rel=0), key
    assert any(g.abs().max() > 0 for g in g_plain.values())
    for name, g in g_shared.items():
        torch.testing.assert_close(g, g_plain[name], atol=1e-5, rtol=0, msg=name)
