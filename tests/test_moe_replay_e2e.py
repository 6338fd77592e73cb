"""Routing replay end to end on the tiny MoE (issue 44): the CPU engine samples and records its routes, Megatron-core
scores the same tokens replaying them. Unperturbed, the trainer routes as the engine did and its log-probs equal
the engine's within the dense model's tolerance. Negative control: a trainer router a little off (as a few steps
of staleness leave it) routes other experts on its own and its log-probs drift from the engine's; replaying the
engine's routes forces them back and the gap shrinks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.rollout import engine_routes
from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
from slime_server.rollout.protocol import SamplingParams
from slime_server.trainer import routing_replay
from slime_server.trainer.convert import load_hf_checkpoint_into
from slime_server.trainer.model import build_gpt_model
from slime_server.trainer.parallel import parallel_context
from slime_server.trainer.train_step import compute_logprobs
from slime_server.trainer.types import TrainSample

PROMPTS = [list(range(20, 44)), list(range(300, 330)), [7, 8, 9] * 6, list(range(900, 915))]


@pytest.fixture(scope="module")
def rollouts():
    """The engine's samples of the tiny MoE: tokens, log-probs and routes, as the gateway records them."""
    from transformers import AutoConfig

    from slime_server.models.tiny import ensure_tiny_model, tiny_moe_spec

    path = ensure_tiny_model(spec=tiny_moe_spec())
    config = AutoConfig.from_pretrained(path)
    engine = CPUEngine(EngineConfig(model_path=str(path), enable_return_routed_experts=True))
    samples = []
    try:
        for i, prompt in enumerate(PROMPTS):
            sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, sampling_seed=i)
            (out,) = engine.generate(prompt, sp, return_logprob=True, return_routed_experts=True)
            routes = engine_routes.decode(out.meta_info.routed_experts, config.num_hidden_layers,
                                          config.num_experts_per_tok)
            m = len(out.output_ids)
            samples.append(TrainSample(
                tokens=prompt + out.output_ids, loss_mask=[0] * len(prompt) + [1] * m,
                rollout_logprobs=[0.0] * len(prompt) + [e[0] for e in out.meta_info.output_token_logprobs],
                weight_versions=[-1] * len(prompt) + [0] * m, routed_experts=RoutedExperts.of(routes.numpy())))
    finally:
        engine.shutdown()
    return path, config, samples


def _gaps(model, samples: list[TrainSample]) -> np.ndarray:
    """|trainer - engine| log-prob of every generated token."""
    scored = compute_logprobs(model, samples)
    return np.concatenate([np.abs(lp.numpy()[np.array(s.loss_mask, bool)]
                                  - np.array(s.rollout_logprobs)[np.array(s.loss_mask, bool)])
                           for lp, s in zip(scored, samples, strict=True)])


def _used_routes(model) -> torch.Tensor:
    """The experts the last replayed forward used, [tokens, layers, k]."""
    return torch.stack([r.router_replay.recorded for r in routing_replay.routers(model)], dim=1)


def test_replay_routes_as_the_engine_did_and_shrinks_the_gap_of_a_drifted_router(rollouts) -> None:
    path, config, samples = rollouts
    natural = [s.model_copy(update={"routed_experts": None}) for s in samples]
    engine_routes_all = torch.cat([torch.from_numpy(s.routed_experts.array()) for s in samples])
    with parallel_context(tp_size=1):
        model = build_gpt_model(config)
        load_hf_checkpoint_into(model, path)
        routing_replay.take_totals()
        same = _gaps(model, samples)
        agreement = routing_replay.take_totals()
        used = _used_routes(model)  # one micro-batch: every sample's rows, packed in order
        recorded_rows = torch.cat([torch.cat([torch.from_numpy(s.routed_experts.array()),
                                              torch.full((1, config.num_hidden_layers, 2), -1)]) for s in samples])
        known = (recorded_rows >= 0).all(-1).all(-1)
        assert torch.equal(used[known], recorded_rows[known]) and known.sum() == len(engine_routes_all)
        print(f"\nunperturbed: natural/engine top-k agreement {agreement.rate:.4f}, gap max {same.max():.2e} "
              f"mean {same.mean():.2e}")
        assert agreement.total == engine_routes_all.numel() and agreement.rate > 0.999
        assert same.max() < 1e-4  # the dense model's engine/trainer tolerance
        # a router a little off, as a few optimizer steps of staleness leave it
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for router in routing_replay.routers(model):
                w = router.weight
                w.add_(torch.randn(w.shape, generator=gen) * w.std() * 0.3)
        drifted = _gaps(model, natural)
        routing_replay.take_totals()
        replayed = _gaps(model, samples)
        drifted_agreement = routing_replay.take_totals()
        assert torch.equal(_used_routes(model)[known], recorded_rows[known])  # still the engine's experts
        factor = drifted.mean() / replayed.mean()
        print(f"drifted router: natural/engine agreement {drifted_agreement.rate:.3f}; gap mean without replay "
              f"{drifted.mean():.3e}, with replay {replayed.mean():.3e} (x{factor:.1f} smaller)")
        assert drifted_agreement.rate < 0.95
        assert factor > 2
