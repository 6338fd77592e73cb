"""Issue 19 in the real Megatron-core ranks (world size 1, gloo, CPU, the tiny Qwen3 model):

- KL to a frozen reference: 0 on the first step (the policy is the reference), then growing; a large
  ``kl_coef`` keeps the policy's log-probs nearer the reference than the same run without it;
- several optimizer steps per batch against log-probs recomputed once: the ratio is exactly 1 on the
  first mini-batch and moves on the next, where the PPO clip then acts;
- off-policy correction: with deliberately stale rollout log-probs the importance weights differ
  from 1 (and are clipped), with fresh ones (the trainer's own) they are 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._trainer_helpers import make_batch

pytestmark = pytest.mark.timeout(600)


def make_rank(model_path: Path, *, lr: float = 1e-3, reference: bool = False, **loss: object):
    from slime_server.trainer.actor import RendezvousInfo, TrainerRank, TrainerRankSettings
    from slime_server.trainer.settings import LossConfig, OptimizerSettings
    from slime_server.trainer.train_step import TrainStepSettings
    from slime_server.utils.net import find_free_port

    rank = TrainerRank(TrainerRankSettings(
        hf_path=str(model_path), seed=3, torch_threads=2, reference=reference,
        optimizer=OptimizerSettings(lr=lr, clip_grad=1.0),
        train=TrainStepSettings(loss=LossConfig(**loss))), RendezvousInfo(rank=0, world_size=1,
                                                                         master_port=find_free_port()))
    rank.setup()
    return rank


@pytest.fixture
def fresh_world() -> Iterator[None]:
    from slime_server.trainer.parallel import destroy_parallel

    yield
    destroy_parallel()


def batch(model_path: Path, n: int = 4, seed: int = 0, shared: bool = False) -> list:
    from transformers import AutoConfig

    return make_batch(AutoConfig.from_pretrained(model_path).vocab_size, n=n, seed=seed, shared=shared)


def mean_abs_diff(a: list[list[float]], b: list[list[float]], samples: list) -> float:
    diffs = [abs(x - y) for s, xs, ys in zip(samples, a, b, strict=True)
             for x, y, m in zip(xs, ys, s.loss_mask, strict=True) if m]
    return sum(diffs) / len(diffs)


def test_kl_is_zero_on_the_first_step_then_grows(tiny_model_path: Path, fresh_world: None) -> None:
    samples = batch(tiny_model_path)
    rank = make_rank(tiny_model_path, reference=True, loss_type="grpo", kl_coef=0.01, kl_type="low_var_kl")
    kls = [rank.train_step(samples)["kl"] for _ in range(4)]
    assert kls[0] == 0.0  # the policy is the reference before its first update
    assert 0.0 < kls[1] < kls[2] < kls[3], kls
    ref = rank.compute_logprobs(samples, reference=True)
    assert ref == make_rank_logprobs_of_base(tiny_model_path, samples)  # the reference never moved


def make_rank_logprobs_of_base(model_path: Path, samples: list) -> list[list[float]]:
    from slime_server.trainer.parallel import destroy_parallel

    destroy_parallel()
    return make_rank(model_path).compute_logprobs(samples)


def test_a_large_kl_coef_keeps_the_policy_near_the_reference(tiny_model_path: Path, fresh_world: None) -> None:
    from slime_server.trainer.parallel import destroy_parallel

    samples = batch(tiny_model_path, seed=1)
    drift = {}
    for coef in (0.0, 5.0):
        rank = make_rank(tiny_model_path, reference=True, lr=3e-3, loss_type="grpo", kl_coef=coef, kl_type="k2")
        for _ in range(6):
            rank.train_step(samples)
        drift[coef] = mean_abs_diff(rank.compute_logprobs(samples), rank.compute_logprobs(samples, reference=True),
                                    samples)
        destroy_parallel()
    assert 0.0 < drift[5.0] < drift[0.0], drift


def test_recomputed_old_logprobs_make_the_ratio_and_clip_act(tiny_model_path: Path, fresh_world: None) -> None:
    samples = batch(tiny_model_path, n=8, seed=2)
    rank = make_rank(tiny_model_path, lr=5e-3, loss_type="grpo", eps_clip=0.02)
    old = [torch.tensor(o) for o in rank.compute_logprobs(samples)]
    first = rank.train_step(samples[:4], old_logprobs=old[:4])
    second = rank.train_step(samples[4:], old_logprobs=old[4:])
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["clip_fraction"] == 0.0
    assert second["ratio_max"] > 1.0 + 1e-4 or second["ratio_min"] < 1.0 - 1e-4, second
    assert second["clip_fraction"] > 0.0  # the step on the first half moved the policy past the clip range


def test_importance_weights_are_one_when_fresh_and_act_when_stale(tiny_model_path: Path, fresh_world: None) -> None:
    rank = make_rank(tiny_model_path, lr=1e-12, loss_type="grpo", use_tis=True, tis_clip=1.5)
    samples = batch(tiny_model_path, n=4, seed=3)
    own = rank.compute_logprobs(samples)  # what the engine would have recorded for the current policy
    fresh = [s.model_copy(update={"rollout_logprobs": lp}) for s, lp in zip(samples, own, strict=True)]
    m = rank.train_step(fresh)
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["tis_clip_fraction"] == 0.0
    stale = [s.model_copy(update={"rollout_logprobs": [x - 0.7 * (i % 2) for i, x in enumerate(lp)]})
             for s, lp in zip(samples, own, strict=True)]  # every other token 0.7 nats likelier now: w = e^0.7
    m = rank.train_step(stale)
    odd = sum(m_ for s in samples for i, m_ in enumerate(s.loss_mask) if i % 2) / sum(sum(s.loss_mask) for s in samples)
    assert m["tis_clip_fraction"] == pytest.approx(odd, abs=1e-6)  # e^0.7 = 2.01 > 1.5: those tokens are clipped
    assert m["tis_weight_mean"] == pytest.approx(1.5 * odd + 1.0 * (1 - odd), abs=1e-4)


def test_the_critic_learns_the_returns_and_checkpoints_with_the_policy(tiny_model_path: Path, fresh_world: None,
                                                                      tmp_path: Path) -> None:
    """PPO's value model in the ranks: values start at 0 (zero head), the clipped value loss falls and the
    explained variance of the values rises as it trains on fixed GAE returns; a checkpoint restores it."""
    from slime_server.trainer.actor import RendezvousInfo, TrainerRank, TrainerRankSettings
    from slime_server.trainer.advantages import AdvantageConfig, ppo_advantages
    from slime_server.trainer.critic import compute_values, explained_variance
    from slime_server.trainer.settings import CriticSettings, OptimizerSettings
    from slime_server.utils.net import find_free_port

    rank = TrainerRank(TrainerRankSettings(
        hf_path=str(tiny_model_path), seed=3, torch_threads=2,
        critic=CriticSettings(optimizer=OptimizerSettings(lr=1e-3, clip_grad=1.0), value_clip=None)),
        RendezvousInfo(rank=0, world_size=1, master_port=find_free_port()))
    rank.setup()
    samples = batch(tiny_model_path, n=4, seed=5)
    samples = [s.model_copy(update={"reward": float(i % 2)}) for i, s in enumerate(samples)]
    values = rank.compute_values(samples)
    assert all(v == 0.0 for vs in values for v in vs)  # the zero-initialised head
    targets = ppo_advantages(samples, values, AdvantageConfig(estimator="gae", gamma=1.0, lam=1.0))
    masks = [s.loss_mask for s in samples]
    returns = [t.returns for t in targets]
    losses, ev = [], []
    for _ in range(16):
        values = rank.compute_values(samples)
        ev.append(explained_variance(values, returns, masks))
        losses.append(rank.train_critic(targets, values)["value_loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    assert ev[-1] > ev[1] and ev[-1] > 0.3, ev
    # the token tree's values are the plain rows' (a batch whose samples share prefixes)
    shared = batch(tiny_model_path, n=6, seed=7, shared=True)
    plain_v, tree_v = (compute_values(rank.critic.model, shared, share_prefixes=f) for f in (False, True))
    assert any(float(v.abs().max()) > 1e-3 for v in plain_v)
    for a, b in zip(plain_v, tree_v, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    path = rank.save_checkpoint(str(tmp_path / "ckpt"))
    trained = rank.compute_values(samples)
    rank.train_critic(targets, trained)
    assert rank.compute_values(samples) != trained
    rank.load_checkpoint(path)
    assert rank.compute_values(samples) == trained  # the critic came back with the policy


def test_the_reference_and_the_critic_start_from_the_checkpoints_named(tiny_model_path: Path, fresh_world: None,
                                                                       tmp_path: Path) -> None:
    """A job's KL reference can be another checkpoint than the policy's base weights (``reference_path``): its
    log-probs are that checkpoint's (HF's forward on it), not the policy's; a critic's trunk starts from the
    checkpoint named in ``critic.init_from``."""
    from transformers import AutoModelForCausalLM

    from slime_server.trainer.actor import RendezvousInfo, TrainerRank, TrainerRankSettings
    from slime_server.trainer.convert import export_hf_state_dict
    from slime_server.trainer.settings import CriticSettings
    from slime_server.utils.net import find_free_port
    from tests._engine_helpers import hf_logprobs

    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(other))
    rank = TrainerRank(TrainerRankSettings(
        hf_path=str(tiny_model_path), seed=3, torch_threads=2, reference=True, reference_path=str(other),
        critic=CriticSettings(init_from=str(other))), RendezvousInfo(rank=0, world_size=1, master_port=find_free_port()))
    rank.setup()
    samples = batch(tiny_model_path, n=2, seed=9)
    policy, ref = rank.compute_logprobs(samples), rank.compute_logprobs(samples, reference=True)
    for s, lp_ref, lp_policy in zip(samples, ref, policy, strict=True):
        want = [0.0] + hf_logprobs(model.eval(), s.tokens[:1], s.tokens[1:], 1.0)
        torch.testing.assert_close(torch.tensor(lp_ref), torch.tensor(want, dtype=torch.float32), atol=1e-4, rtol=0)
        assert max(abs(a - b) for a, b in zip(lp_ref, lp_policy, strict=True)) > 0.01
    critic = rank.critic.model.module
    vocab = model.config.vocab_size
    assert torch.equal(critic.embedding.word_embeddings.weight[:vocab], model.model.embed_tokens.weight)
    assert torch.equal(critic.decoder.final_layernorm.weight, model.model.norm.weight)
    assert not torch.equal(export_hf_state_dict(rank.bundle.model)["model.norm.weight"], model.model.norm.weight)
