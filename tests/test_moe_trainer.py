"""Mixture-of-experts in the trainer (CPU): Qwen3-MoE <-> Megatron-core conversion, logits parity with HF, and
routing replay (R3): a replayed forward is the recorded one bit for bit, replayed routes are really forced, and
the router still learns under replay; R2: the old policy's routes recorded with its log-probs, replayed after an
update."""

from __future__ import annotations

import pytest
import torch

from slime_server.trainer import routing_replay
from slime_server.trainer.convert import (
    export_hf_state_dict,
    gather_from_tp,
    hf_to_megatron,
    load_hf_checkpoint_into,
    megatron_to_hf,
    read_hf_state_dict,
    split_for_tp,
)
from slime_server.trainer.model import arch_from_hf_config, build_gpt_model, forward_logits
from slime_server.trainer.parallel import parallel_context
from tests._megatron_helpers import save_random_hf_model

EXPERTS, TOPK = 8, 2


def moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True, max_position_embeddings=256,
                    rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return Qwen3MoeConfig(**{**settings, **overrides})


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    torch.set_num_threads(2)
    with parallel_context(tp_size=1) as layout:
        yield layout


@pytest.fixture(scope="module", params=[True, False], ids=["norm-topk", "softmax-weights"])
def moe_case(request, tmp_path_factory):
    """A random Qwen3-MoE (every tensor randomised) with renormalised top-k weights, and one with the full
    softmax's weights (``norm_topk_prob`` false: Megatron's pre-softmax routing)."""
    config = moe_config(norm_topk_prob=request.param)
    path = tmp_path_factory.mktemp("moe")
    hf_model = save_random_hf_model(config, path)
    megatron = build_gpt_model(config)
    load_hf_checkpoint_into(megatron, path)
    return config, path, hf_model, megatron


def ids_of(config, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def test_logits_match_hf(moe_case):
    config, _path, hf_model, megatron = moe_case
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = forward_logits(megatron, ids), hf_model(ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


def test_export_is_the_checkpoint_bit_for_bit(moe_case):
    _config, path, _hf_model, megatron = moe_case
    exported, on_disk = export_hf_state_dict(megatron), read_hf_state_dict(path)
    assert set(exported) == set(on_disk)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported and "model.layers.0.mlp.gate.weight" in exported
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)


def test_mapping_roundtrip_and_tp_split(moe_case):
    config, path, _hf_model, _megatron = moe_case
    arch = arch_from_hf_config(config)
    hf_state = read_hf_state_dict(path)
    for fused in (False, True):  # an MoE layer's MLP norm is pre_mlp_layernorm in both specs
        full = hf_to_megatron(hf_state, arch, fused_norms=fused)
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in full
        back = dict(megatron_to_hf(full, arch))
        assert back.keys() == hf_state.keys() and all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    shard1 = split_for_tp(fc1, full[fc1], 1, 2)  # TP rank 1 holds the second half of gate and of up
    half = arch.moe_ffn_hidden_size // 2
    assert torch.equal(shard1[:half], hf_state["model.layers.0.mlp.experts.3.gate_proj.weight"][half:])
    assert torch.equal(shard1[half:], hf_state["model.layers.0.mlp.experts.3.up_proj.weight"][half:])
    fc2 = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"
    assert torch.equal(split_for_tp(fc2, full[fc2], 0, 2), full[fc2][:, : half])  # row-parallel
    router = "decoder.layers.0.mlp.router.weight"
    assert torch.equal(split_for_tp(router, full[router], 1, 2), full[router])  # replicated
    for name, tensor in full.items():
        assert torch.equal(gather_from_tp(name, [split_for_tp(name, tensor, r, 2) for r in range(2)]), tensor), name


def test_replaying_recorded_routes_is_the_recorded_forward_bit_for_bit(moe_case):
    config, _path, _hf_model, megatron = moe_case
    ids = ids_of(config, 17)
    with torch.no_grad(), routing_replay.recording(megatron) as found:
        recorded = forward_logits(megatron, ids)
    routes = torch.stack(found, dim=1)
    assert routes.shape == (17, config.num_hidden_layers, TOPK)
    with torch.no_grad(), routing_replay.replaying(megatron, routes) as agreement:
        replayed = forward_logits(megatron, ids)
    assert torch.equal(replayed, recorded)
    assert agreement.total == routes.numel() and agreement.rate == 1.0


def _expert_token_counts(megatron) -> tuple[list[list[int]], list]:
    """Hooks counting the tokens each local expert of each layer receives, and the handles to remove them."""
    counts = [[0] * EXPERTS for _ in megatron.decoder.layers]
    handles = []
    for li, layer in enumerate(megatron.decoder.layers):
        for e, expert in enumerate(layer.mlp.experts.local_experts):
            def count(_module, args, _out, li=li, e=e):
                counts[li][e] += args[0].shape[0]
            handles.append(expert.register_forward_hook(count))
    return counts, handles


def test_replayed_routes_are_forced_and_the_router_still_learns(moe_case):
    config, _path, _hf_model, megatron = moe_case
    ids = ids_of(config, 19, seed=2)
    with torch.no_grad(), routing_replay.recording(megatron) as found:
        natural = forward_logits(megatron, ids)
    recorded = torch.stack(found, dim=1)
    # for every token and layer, experts the router did not choose (the highest-numbered others)
    chosen = torch.zeros(*recorded.shape[:2], EXPERTS, dtype=torch.bool).scatter(2, recorded, True)
    forced = torch.where(chosen, -1, torch.arange(EXPERTS)).topk(TOPK, dim=2).values
    assert not (forced.unsqueeze(-1) == recorded.unsqueeze(-2)).any()
    counts, handles = _expert_token_counts(megatron)
    megatron.zero_grad()
    try:
        with routing_replay.replaying(megatron, forced) as agreement:
            logits = forward_logits(megatron, ids)
            logits.float().logsumexp(-1).mean().backward()
    finally:
        for h in handles:
            h.remove()
    for li in range(config.num_hidden_layers):
        assert counts[li] == torch.bincount(forced[:, li].flatten(), minlength=EXPERTS).tolist()
    # the first layer sees the recorded forward's input, so its router would never have chosen these; later layers
    # see what the forced experts computed, and their natural choices move too
    assert agreement.layers[0].rate == 0.0 and agreement.rate < 0.5
    assert (logits - natural).abs().max() > 1e-2  # the forward really changed
    for layer in megatron.decoder.layers:
        grad = layer.mlp.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    megatron.zero_grad()


def _samples(config, lengths: tuple[int, ...]) -> list:
    from slime_server.trainer.types import TrainSample

    out = []
    for i, n in enumerate(lengths):
        tokens = ids_of(config, n, seed=10 + i)[0].tolist()
        out.append(TrainSample(tokens=tokens, loss_mask=[0] * 3 + [1] * (n - 3), rollout_logprobs=[0.0] * n,
                               weight_versions=[-1] * 3 + [0] * (n - 3)))
    return out


def test_r2_records_the_old_policys_routes_and_the_updated_policy_replays_them(moe_case):
    """``routing_replay: trainer`` (R2): the log-prob pass before a batch's updates also returns the experts each
    sample's tokens went to (each sample as its own forward routes it, all but its last token); after an update
    moved the routers (the first mini-batch's), a forward of those samples carrying them routes every recorded
    position to the recorded experts although the routers now choose otherwise for some."""
    from slime_server.trainer.train_step import compute_logprobs, compute_logprobs_and_routes

    config, _path, _hf_model, megatron = moe_case
    samples = _samples(config, (11, 7, 15))
    lps, routes = compute_logprobs_and_routes(megatron, samples)
    plain = compute_logprobs(megatron, samples, share_prefixes=False)
    assert all(torch.equal(a, b) for a, b in zip(lps, plain, strict=True))
    for sample, r in zip(samples, routes, strict=True):
        with torch.no_grad(), routing_replay.recording(megatron) as found:
            forward_logits(megatron, torch.tensor([sample.tokens]))
        alone = torch.stack(found, dim=1)
        assert (r.layers, r.topk, r.positions) == (config.num_hidden_layers, TOPK, len(sample.tokens) - 1)
        assert torch.equal(torch.from_numpy(r.array()).sort(-1).values, alone[:-1].sort(-1).values)

    gates = [layer.mlp.router.weight for layer in megatron.decoder.layers]
    kept = [g.detach().clone() for g in gates]
    try:
        with torch.no_grad():  # as an update would move them: 0.3 of each router's spread
            for g in gates:
                g.add_(0.3 * g.std() * torch.randn(g.shape, generator=torch.Generator().manual_seed(3)))
        carrying = [x.model_copy(update={"routed_experts": r}) for x, r in zip(samples, routes, strict=True)]
        routing_replay.take_totals()
        compute_logprobs(megatron, carrying)  # one micro-batch: the routers keep what it used
        agreement = routing_replay.take_totals()
        used = torch.stack([router.router_replay.recorded for router in routing_replay.routers(megatron)], dim=1)
        offset = 0
        for sample, r in zip(samples, routes, strict=True):
            n = len(sample.tokens)
            assert torch.equal(used[offset:offset + n - 1], torch.from_numpy(r.array()))
            offset += n
        assert 0 < agreement.rate < 1, agreement  # the moved routers would have chosen otherwise somewhere
    finally:
        with torch.no_grad():
            for g, k in zip(gates, kept, strict=True):
                g.copy_(k)


def test_the_token_tree_shares_a_prefix_only_where_its_routes_agree(moe_case):
    """Samples carrying routes share a common prefix's rows in the forward only where every position of it was
    routed alike: with their own (equal) routes the tree shares the prefix; after one sample's routes for a prefix
    position change, the tree splits there; either way each sample's replayed log-probs equal its packed row's."""
    import numpy as np

    from slime_server.buffer.routed_experts import RoutedExperts
    from slime_server.trainer.packing import pack_samples
    from slime_server.trainer.train_step import compute_logprobs, compute_logprobs_and_routes
    from slime_server.trainer.types import TrainSample

    config, _path, _hf_model, megatron = moe_case
    prefix = ids_of(config, 8, seed=20)[0].tolist()
    samples = [TrainSample(tokens=prefix + ids_of(config, 5, seed=21 + i)[0].tolist(), loss_mask=[0] * 8 + [1] * 5,
                           rollout_logprobs=[0.0] * 13, weight_versions=[-1] * 8 + [0] * 5) for i in range(3)]
    _, routes = compute_logprobs_and_routes(megatron, samples)
    assert all(np.array_equal(r.array()[:8], routes[0].array()[:8]) for r in routes)  # the same prefix, routed alike
    other = routes[1].array().copy()
    other[4] = (other[4] + 1) % EXPERTS  # position 4 of the prefix through other experts
    for carried in (routes, [routes[0], RoutedExperts.of(other), routes[2]]):
        batch = [x.model_copy(update={"routed_experts": r}) for x, r in zip(samples, carried, strict=True)]
        (mb,) = pack_samples(batch, 1024, share_prefixes=True)
        assert mb.tree is not None and mb.route_rows is not None and mb.route_rows.shape[0] == mb.tree.num_rows
        # shared rows: the whole prefix twice over, or only its first 4 positions for the sample routed otherwise
        assert mb.tree.num_rows == (39 - 16 if carried is routes else 39 - 8 - 4)
        shared = compute_logprobs(megatron, batch, share_prefixes=True)
        alone = compute_logprobs(megatron, batch, share_prefixes=False)
        for a, b in zip(shared, alone, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_r2_needs_an_moe_model():
    from transformers import Qwen3Config

    from slime_server.trainer.train_step import compute_logprobs_and_routes

    config = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    dense = build_gpt_model(config)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        compute_logprobs_and_routes(dense, _samples(config, (5,)))


def test_replay_refuses_routes_of_the_wrong_shape(moe_case):
    config, _path, _hf_model, megatron = moe_case
    ids = ids_of(config, 5)
    good = torch.zeros(5, config.num_hidden_layers, TOPK, dtype=torch.long)
    with pytest.raises(ValueError, match="MoE layers"):
        with routing_replay.replaying(megatron, good[:, :1]):
            pass
    with pytest.raises(ValueError, match="routes"), torch.no_grad():
        with routing_replay.replaying(megatron, good[:4]):
            forward_logits(megatron, ids)
    with torch.no_grad():  # a refused replay leaves the routers routing naturally
        with routing_replay.recording(megatron) as found:
            forward_logits(megatron, ids)
    assert len(found) == config.num_hidden_layers


def test_unsupported_moe_layouts_are_refused():
    with pytest.raises(ValueError, match="dense MLP layers"):
        arch_from_hf_config(moe_config(decoder_sparse_step=2))
    with pytest.raises(ValueError, match="dense MLP layers"):
        arch_from_hf_config(moe_config(mlp_only_layers=[0]))
    arch = arch_from_hf_config(moe_config())
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.moe_norm_topk) == (EXPERTS, TOPK, 32, True)


def test_lora_on_experts_is_refused_by_name():
    from slime_server.trainer.lora import attach_lora
    from slime_server.trainer.settings import LoRASettings

    megatron = build_gpt_model(moe_config())
    with pytest.raises(ValueError, match="experts.*down_proj"):
        attach_lora(megatron, LoRASettings(rank=4, target_modules=["q_proj", "down_proj"]))


def test_the_tiny_moe_checkpoint_is_served_by_megatron_as_by_hf(tmp_path):
    """The locally built tiny MoE (the one the engine and the jobs use) converts as the random ones do."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_server.models.tiny import ensure_tiny_model, tiny_moe_spec

    path = ensure_tiny_model(spec=tiny_moe_spec())
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen3_moe"
    megatron = build_gpt_model(config).eval()
    load_hf_checkpoint_into(megatron, path)
    ids = ids_of(config, 24, seed=3)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
        torch.testing.assert_close(forward_logits(megatron, ids), ref, rtol=0, atol=1e-4)
