"""The CPU patches let real Megatron-core train: DDP grad buffers, Megatron optimizer with
grad clipping, the RNG tracker fork and the default causal mask all work without CUDA."""

from __future__ import annotations

import pytest
import torch

from slime_server.trainer.megatron_cpu import apply_cpu_patches, cuda_available
from slime_server.trainer.model import build_gpt_model, forward_logits
from slime_server.trainer.parallel import parallel_context
from tests._megatron_helpers import make_config

pytestmark = pytest.mark.skipif(cuda_available(), reason="CPU patches are inactive on a GPU build")


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    torch.set_num_threads(2)
    with parallel_context(tp_size=1, seed=7) as layout:
        yield layout


def test_patches_are_idempotent_and_installed():
    from megatron.core.tensor_parallel import random as mrandom

    assert apply_cpu_patches() is True
    assert apply_cpu_patches() is True
    assert type(mrandom.get_cuda_rng_tracker()).__name__ == "CpuRNGStatesTracker"


def test_rng_fork_is_isolated_and_reproducible():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    states = {k: v.clone() for k, v in tracker.get_states().items()}
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default generator is untouched
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the forked stream advanced
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)  # restoring states replays the stream


def test_default_causal_mask_path_matches_explicit_mask():
    config = make_config("qwen3", num_key_value_heads=2)
    model = build_gpt_model(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        implicit = model(input_ids=ids, position_ids=torch.arange(10).expand(2, 10), attention_mask=None)
        explicit = forward_logits(model, ids)
    torch.testing.assert_close(implicit[..., : config.vocab_size], explicit, rtol=0, atol=1e-6)


def test_megatron_ddp_and_optimizer_train_on_cpu():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = make_config("llama", num_key_value_heads=2)
    model = build_gpt_model(config)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=0.5), [ddp])
    ids = torch.randint(0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, norms = [], []
    for _ in range(6):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        logits = forward_logits(ddp, ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(loss.item())
        norms.append(grad_norm)
    assert all(n > 0 for n in norms)
    assert losses[-1] < losses[0] - 0.1
    assert all(not torch.equal(start[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_gives_the_same_gradients(granularity):
    config = make_config("qwen3", num_key_value_heads=2)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    recompute = {"recompute_granularity": granularity}
    if granularity == "full":
        recompute |= {"recompute_method": "uniform", "recompute_num_layers": 1}
    plain = build_gpt_model(config)
    recomputed = build_gpt_model(config, **recompute)
    recomputed.load_state_dict(plain.state_dict())
    for model in (plain, recomputed):
        forward_logits(model, ids).logsumexp(-1).sum().backward()
    grads = dict(plain.named_parameters())
    for name, param in recomputed.named_parameters():
        assert param.grad.abs().sum() > 0, name
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6)


def test_megatron_imports_without_torchs_compiler_and_its_fusions_stay_eager() -> None:
    """In a fresh process (this one has long imported Megatron): importing the trainer, then Megatron's model
    code, loads neither dynamo nor inductor, and ``jit_fuser`` returns a fusion unchanged. Without
    ``trainer/fusions.py`` both are loaded (~1.4 s of every rank's start) and ``jit_fuser`` is
    ``torch.compile``."""
    import subprocess
    import sys

    code = ("import sys, slime_server.trainer.model\n"
            "from megatron.core.jit import jit_fuser\n"
            "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
            "f = lambda x: x\n"
            "print(jit_fuser(f) is f, 'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules,\n"
            "      hasattr(bias_gelu, '__wrapped__'))\n")  # a compiled fusion wraps the function
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "False", "False"]
