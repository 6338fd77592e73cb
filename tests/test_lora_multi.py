"""Several users' adapters in one trainer step (issue 43): a multi-adapter LoRA trainer holds one adapter per user
over the one frozen base; each sample of a micro-batch goes through its own user's adapter in the shared forward
and backward, instead of one adapter swapped in at a time.

Checked against the one-adapter trainer, which tests/test_lora.py checks against PEFT: each user's log-probs and
gradients in a mixed batch equal a one-adapter model holding that user's adapter alone; a prefix is shared only
under one adapter; a step changes only the adapters its samples name (parameters and Adam moments, bit for bit);
each adapter is stepped at its own Adam step count: a user seated mid-job trains as in a fresh trainer, and one
parked and back as if they had never left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slime_server.trainer.adapter_isolation import stacked_adapters
from slime_server.trainer.convert import load_hf_checkpoint_into
from slime_server.trainer.lora import attach_lora
from slime_server.trainer.model import build_gpt_model, unwrap
from slime_server.trainer.optimizer import build_optimizer
from slime_server.trainer.packing import pack_samples
from slime_server.trainer.parallel import parallel_context
from slime_server.trainer.peft_io import load_adapter_state, megatron_name, peft_state_dict
from slime_server.trainer.portable import _torch_optimizers
from slime_server.trainer.settings import LoRASettings, LossConfig, OptimizerSettings
from slime_server.trainer.train_step import TrainStepSettings, compute_logprobs, forward_backward, train_step
from tests._megatron_helpers import make_config, save_random_hf_model
from tests._trainer_helpers import make_batch

USERS = 3
LORA = LoRASettings(rank=4, alpha=8.0, target_modules="all-linear", adapters=USERS)
ONE = LORA.model_copy(update={"adapters": 1})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora-multi") / "llama"
    save_random_hf_model(make_config("llama", num_key_value_heads=2, tie_word_embeddings=True), path, seed=5)
    return path


def _model(path: Path, lora: LoRASettings) -> Any:
    from transformers import AutoConfig

    model = build_gpt_model(AutoConfig.from_pretrained(str(path)))
    load_hf_checkpoint_into(model, path)
    attach_lora(model, lora, seed=7)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a fresh B is zero: random ones, each adapter its own, so a mixed-up row shows
        for name, p in unwrap(model).named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _users(samples: list[Any]) -> list[Any]:
    return [s.model_copy(update={"adapter": i % USERS}) for i, s in enumerate(samples)]


def _alone(path: Path, stacked: Any, user: int) -> Any:
    """A one-adapter model holding ``user``'s adapter of ``stacked``."""
    single = _model(path, ONE)
    load_adapter_state(single, {megatron_name(k): v for k, v in peft_state_dict(stacked, user).items()})
    return single


@pytest.mark.parametrize("share", [False, True])
def test_each_user_in_a_mixed_batch_is_computed_as_alone(model_path: Path, share: bool) -> None:
    torch.set_num_threads(2)
    samples = _users(make_batch(vocab_size=101, n=9, seed=2, shared=share))
    step = TrainStepSettings(max_tokens_per_micro_batch=96, share_prefixes=share, loss=LossConfig(loss_type="grpo"))
    with parallel_context(tp_size=1):
        bundle = build_optimizer(_model(model_path, LORA), OptimizerSettings(lr=1e-3))
        mixed = compute_logprobs(bundle.model, samples)
        forward_backward(bundle, samples, step)
        grads = {n: p.main_grad.clone() for n, p in unwrap(bundle.model).named_parameters() if p.requires_grad}
        for user in range(USERS):
            alone = build_optimizer(_alone(model_path, bundle.model, user), OptimizerSettings(lr=1e-3))
            mine = [i for i, s in enumerate(samples) if s.adapter == user]
            for i, lp in zip(mine, compute_logprobs(alone.model, [samples[i] for i in mine]), strict=True):
                torch.testing.assert_close(mixed[i], lp, atol=1e-5, rtol=0)
            # the same batch, the other users' samples weighing nothing (advantage 0): their loss normaliser kept
            silent = [s if s.adapter == user else s.model_copy(update={"advantages": [0.0] * len(s.tokens)})
                      for s in samples]
            forward_backward(alone, [s.model_copy(update={"adapter": 0}) for s in silent], step)
            for name, p in unwrap(alone.model).named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(grads[name][user], p.main_grad, atol=1e-6, rtol=1e-4, msg=name)
    assert all(float(g[u].abs().max()) > 0 for g in grads.values() for u in range(USERS))


def test_a_prefix_is_shared_only_under_one_adapter() -> None:
    """Two samples with the same tokens share their rows under one adapter, not under two."""
    same = make_batch(vocab_size=101, n=1, seed=1)[0]
    for adapters, shared in (((1, 1), True), ((1, 2), False)):
        pair = [same.model_copy(update={"adapter": a}) for a in adapters]
        (mb,) = pack_samples(pair, 1000, share_prefixes=True)
        assert (mb.tree is not None) == shared
        if mb.tree is not None:
            assert mb.tree.tokens.tolist() == same.tokens and mb.adapter_rows.tolist() == [1] * len(same.tokens)


def test_a_step_changes_only_the_adapters_it_trains(model_path: Path) -> None:
    """Adam and weight decay move nothing of a user absent from the step: parameters and moments bit for bit."""
    samples = _users(make_batch(vocab_size=101, n=6, seed=4))
    step = TrainStepSettings(max_tokens_per_micro_batch=96, share_prefixes=False, loss=LossConfig(loss_type="grpo"))

    def snapshot(bundle: Any, user: int) -> list[torch.Tensor]:
        params = stacked_adapters(bundle.model)
        states = [t for opt in _torch_optimizers(bundle) for p in params for t in opt.state.get(p, {}).values()
                  if isinstance(t, torch.Tensor) and t.shape == p.shape]
        return [t[user].clone() for t in params + states]

    with parallel_context(tp_size=1):
        bundle = build_optimizer(_model(model_path, LORA), OptimizerSettings(lr=1e-2, weight_decay=0.1))
        train_step(bundle, samples, step)  # every user once: each has Adam moments now
        before = {u: snapshot(bundle, u) for u in range(USERS)}
        train_step(bundle, [s for s in samples if s.adapter != 1], step)
        after = {u: snapshot(bundle, u) for u in range(USERS)}
    assert len(before[1]) == 3 * len(stacked_adapters(bundle.model))  # parameter, exp_avg, exp_avg_sq
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))
    for u in (0, 2):
        assert not torch.equal(before[u][0], after[u][0])


def test_a_slot_is_given_to_another_user_fresh_or_from_their_saved_adapter(model_path: Path, tmp_path: Path) -> None:
    """A per-user job's slot changing hands: fresh (A as the slot started, B = 0) or a parked user's adapter loaded
    back (saved without its Adam state: moments zero), every other slot bit for bit."""
    from slime_server.trainer.adapter_isolation import set_adapter
    from slime_server.trainer.peft_io import read_peft_adapter, save_peft_adapter

    samples = _users(make_batch(vocab_size=101, n=6, seed=4))
    step = TrainStepSettings(max_tokens_per_micro_batch=96, share_prefixes=False, loss=LossConfig(loss_type="grpo"))
    with parallel_context(tp_size=1):
        bundle = build_optimizer(_model(model_path, LORA), OptimizerSettings(lr=1e-2))
        fresh = build_optimizer(_model(model_path, LORA), OptimizerSettings(lr=1e-2))
        train_step(bundle, samples, step)  # every slot trained: moments everywhere
        params = stacked_adapters(bundle.model)
        before = [p.detach().clone() for p in params]
        save_peft_adapter(tmp_path / "parked", bundle.model, LORA, str(model_path), 1)  # user 1's adapter, saved
        parked = read_peft_adapter(tmp_path / "parked")[1]
        set_adapter(bundle, 1, None, seed=7)  # _model attaches with seed 7
        names = [n for n, q in unwrap(bundle.model).named_parameters() if q.dim() == 3 and q.requires_grad]
        for name, p, start, old in zip(names, params, stacked_adapters(fresh.model), before, strict=True):
            if name.endswith("lora_B"):  # as the slot started: B = 0, A its own start
                assert float(p[1].abs().max()) == 0, name
            else:
                assert torch.equal(p[1], start[1]), name
            assert torch.equal(p[0], old[0]) and torch.equal(p[2], old[2])
        moments = [t for opt in _torch_optimizers(bundle) for p in params for t in opt.state.get(p, {}).values()
                   if isinstance(t, torch.Tensor) and t.shape == p.shape]
        assert moments and all(float(t[1].abs().max()) == 0 and float(t[0].abs().max()) > 0 for t in moments)
        set_adapter(bundle, 1, parked, seed=7)  # the parked user back in the slot
        for p, old in zip(params, before, strict=True):
            assert torch.equal(p, old)


def _rows(bundle: Any, slot: int) -> list[torch.Tensor]:
    """Slot ``slot``'s parameters and Adam moments."""
    params = stacked_adapters(bundle.model)
    states = [t for opt in _torch_optimizers(bundle) for p in params for k, t in opt.state.get(p, {}).items()
              if k in ("exp_avg", "exp_avg_sq")]
    return [t[slot].clone() for t in params + states]


def _counts(bundle: Any) -> tuple[int, ...]:
    return tuple(bundle.slot_steps)


SETTINGS = OptimizerSettings(lr=1e-2, weight_decay=0.1, clip_grad=0.0)  # no clipping: a batch-wide norm


def test_a_user_seated_mid_job_is_stepped_as_in_a_fresh_trainer(model_path: Path) -> None:
    """Slot 1 given to a newcomer after three steps: their two steps move their adapter (and Adam moments) as the
    same two steps move it in a trainer that starts with them, not by the bias correction of the job's step (at
    step 4 that would be about 3.2 lr per weight where their own first step is lr)."""
    from slime_server.trainer.adapter_isolation import set_adapter

    samples = _users(make_batch(vocab_size=101, n=6, seed=4))
    step = TrainStepSettings(max_tokens_per_micro_batch=96, share_prefixes=False, loss=LossConfig(loss_type="grpo"))
    with parallel_context(tp_size=1):
        job = build_optimizer(_model(model_path, LORA), SETTINGS)
        for _ in range(3):
            train_step(job, samples, step)
        set_adapter(job, 1, None, seed=7)
        fresh = build_optimizer(_model(model_path, LORA), SETTINGS)
        set_adapter(fresh, 1, None, seed=7)
        assert all(torch.equal(a, b) for a, b in zip(_rows(job, 1)[:len(stacked_adapters(job.model))],
                                                     _rows(fresh, 1), strict=False))
        for _ in range(2):
            train_step(job, samples, step)
            train_step(fresh, samples, step)
        assert _counts(job) == (5, 2, 5) and _counts(fresh) == (2, 2, 2)
        for mine, theirs in zip(_rows(job, 1), _rows(fresh, 1), strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=1e-5)
        assert float(_rows(job, 1)[1].abs().max()) > 0  # B moved off zero


def test_a_user_parked_and_back_trains_as_if_they_never_left(model_path: Path, tmp_path: Path) -> None:
    """Bob gives slot 1 to Carol for a step (saved with his Adam moments and count), then has it back: his next step
    moves his adapter and moments as it does where he kept the slot and sat the step out. The counts survive a
    checkpoint, on its own layout and through the portable file."""
    from slime_server.trainer.adapter_adam import read_slot_adam, save_slot_adam
    from slime_server.trainer.adapter_isolation import set_adapter
    from slime_server.trainer.checkpoint import load_checkpoint, save_checkpoint
    from slime_server.trainer.peft_io import read_peft_adapter, save_peft_adapter
    from slime_server.trainer.portable import load_portable

    samples = _users(make_batch(vocab_size=101, n=6, seed=4))
    carol = _users(make_batch(vocab_size=101, n=6, seed=9))
    step = TrainStepSettings(max_tokens_per_micro_batch=96, share_prefixes=False, loss=LossConfig(loss_type="grpo"))
    with parallel_context(tp_size=1):
        moved, stayed = (build_optimizer(_model(model_path, LORA), SETTINGS) for _ in range(2))
        for bundle in (moved, stayed):
            train_step(bundle, samples, step)
            train_step(bundle, samples, step)
        bob = _rows(moved, 1)
        save_peft_adapter(tmp_path / "bob", moved.model, LORA, str(model_path), 1)
        save_slot_adam(tmp_path / "bob", moved, 1)
        set_adapter(moved, 1, None, seed=7)  # Carol's, fresh
        train_step(moved, carol, step)
        train_step(stayed, [s for s in samples if s.adapter != 1], step)  # Bob sits a step out
        set_adapter(moved, 1, read_peft_adapter(tmp_path / "bob")[1], seed=7, adam=read_slot_adam(tmp_path / "bob"))
        assert all(torch.equal(a, b) for a, b in zip(_rows(moved, 1), bob, strict=True))
        assert _counts(moved) == (3, 2, 3) == _counts(stayed)
        train_step(moved, samples, step)
        train_step(stayed, samples, step)
        for mine, theirs in zip(_rows(moved, 1), _rows(stayed, 1), strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=1e-6)
        assert not torch.equal(_rows(moved, 1)[0], bob[0])

        save_checkpoint(tmp_path / "ckpt", moved, step=4, policy_version=4, portable=True)
        for load in (load_checkpoint, load_portable):
            again = build_optimizer(_model(model_path, LORA), SETTINGS)
            train_step(again, samples, step)  # a state to load over
            load(tmp_path / "ckpt", again)
            assert _counts(again) == _counts(moved), load.__name__
