"""The trainer's gradient is HF's: Megatron-core on CPU (packed micro-batches, block-diagonal masks, the GRPO loss
normalised over the global batch, the tied embedding's two uses summed, Qwen3's q/k norms) against an independent
HF forward and backward of the same loss, parameter by parameter."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from slime_server.trainer.convert import hf_to_megatron, load_hf_checkpoint_into, uses_fused_norms
from slime_server.trainer.losses import policy_loss
from slime_server.trainer.model import build_attention_mask, build_gpt_model, unwrap
from slime_server.trainer.optimizer import build_optimizer
from slime_server.trainer.packing import pack_samples
from slime_server.trainer.parallel import parallel_context
from slime_server.trainer.settings import LossConfig, OptimizerSettings
from slime_server.trainer.train_step import TrainStepSettings, forward_backward
from slime_server.trainer.types import TrainSample


def _samples(vocab: int, pad_id: int | None, n: int = 8, seed: int = 0) -> list[TrainSample]:
    """Random tokens of ragged lengths, never the pad id: HF builds its embedding with ``padding_idx`` (that row
    gets no gradient from lookups) and Megatron does not; a real chat never feeds the pad token either."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t != pad_id]
    out = []
    for i in range(n):
        length = rng.randint(40, 90)
        prompt = rng.randint(5, length // 2)
        mask = [0] * prompt + [1] * (length - prompt)
        adv = rng.uniform(-1.5, 1.5)
        out.append(TrainSample(
            tokens=[rng.choice(allowed) for _ in range(length)], loss_mask=mask,
            rollout_logprobs=[-rng.uniform(2.0, 6.0) * m for m in mask], reward=adv, group_id=f"g{i // 2}",
            weight_versions=[0 if m else -1 for m in mask], advantages=[adv * m for m in mask], sample_id=str(i)))
    return out


def test_megatron_gradient_equals_hfs(tiny_model_path: Path) -> None:
    from megatron.core.distributed import finalize_model_grads
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(str(tiny_model_path))
    assert config.tie_word_embeddings  # the embedding's gradient sums its lookup and the output layer's
    samples = _samples(config.vocab_size, config.pad_token_id)
    settings = TrainStepSettings(max_tokens_per_micro_batch=192, loss=LossConfig(loss_type="grpo"))
    assert len(pack_samples(samples, 192)) >= 3  # several micro-batches accumulate into one gradient
    with parallel_context(tp_size=1):
        model = build_gpt_model(config)
        load_hf_checkpoint_into(model, tiny_model_path)
        bundle = build_optimizer(model, OptimizerSettings(lr=1e-5))
        metrics = forward_backward(bundle, samples, settings)
        finalize_model_grads([bundle.model])
        inner = unwrap(bundle.model)
        got = {n: p.main_grad.detach().clone() for n, p in inner.named_parameters()}
        arch, fused = inner.arch, uses_fused_norms(inner)

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).train()
    total = 0.0
    for mb in pack_samples(samples, settings.max_tokens_per_micro_batch):
        ids, pos = mb.tokens[None], mb.position_ids[None]
        logits = hf(input_ids=ids, position_ids=pos, attention_mask=~build_attention_mask(pos)).logits[0]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        lp = torch.cat([logp.new_zeros(1), logp.gather(-1, ids[0, 1:, None])[:, 0]])
        lp = lp.masked_fill(mb.position_ids == 0, 0.0)
        loss, _ = policy_loss(settings.loss, logprobs=lp, old_logprobs=lp.detach(),
                              rollout_logprobs=mb.rollout_logprobs, advantages=mb.advantages, loss_mask=mb.loss_mask,
                              sample_lens=mb.sample_lens, entropy=None, token_weights=mb.token_weights)
        loss.backward()
        total += float(loss)
    assert metrics["loss"] == pytest.approx(total, abs=1e-6)
    want = hf_to_megatron({n: p.grad for n, p in hf.named_parameters()}, arch, fused_norms=fused)
    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert float(want["embedding.word_embeddings.weight"].abs().sum()) > 0
