"""Make megatron-core 0.16.1 run on a CPU-only torch build.

Megatron-core hard-codes CUDA in a handful of places that a tiny CPU model still reaches.
Rather than monkeypatching ``torch.cuda`` for the whole process, each affected Megatron
module gets its own view of ``torch`` (``_CpuTorch``) in which "the CUDA device" is the CPU;
everything else in the process keeps the real ``torch``. Where a device remap cannot help,
the Megatron function is replaced or wrapped: RNG state save/restore, the RNG states tracker,
a ``torch.cuda.FloatTensor`` type assertion in grad clipping, one ``tensor.cuda()`` call, and the frozen-weight
linear's backward (a 3-D matmul CPU torch runs slowly and less accurately). Patches apply only when CUDA is
absent; on a GPU this module does nothing. Each patch below names the Megatron call it replaces.

Written against megatron-core 0.16.1 (pinned in pyproject.toml); ``apply_cpu_patches``
refuses other versions so a silent upgrade cannot half-apply.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

SUPPORTED_MEGATRON_VERSION = "0.16.1"

_APPLIED = False

# torch factory functions that the patched Megatron modules call with a literal device="cuda".
_FACTORIES = ("zeros", "ones", "tensor")


def cuda_available() -> bool:
    """True when this torch build can use a GPU (then no patch is needed)."""
    return torch.cuda.is_available()


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec to the CPU; leave other specs alone."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _remap_device(fn: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    return wrapped


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as seen by a patched Megatron module: the current device is the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*_args: Any, **_kwargs: Any) -> None:
        """CPU work is synchronous (the pipeline's p2p calls this after batched sends)."""


class _CpuTorch(types.ModuleType):
    """``torch`` with CUDA device requests redirected to the CPU (installed per Megatron module)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _remap_device(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class CpuRNGStatesTracker:
    """CPU replacement for ``tensor_parallel.random.CudaRNGStatesTracker``.

    Keeps named CPU generator states; ``fork`` swaps one into the default CPU generator for
    the duration of the block (attention forks the model-parallel state on every forward).
    Subclassing is arranged at patch time so Megatron's ``isinstance`` checks still pass.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        if use_cudagraphable_rng:
            raise ValueError("CUDA-graph-safe RNG needs a GPU")
        self.use_cudagraphable_rng = False  # read by megatron.core.transformer.cuda_graphs
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already registered")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already registered")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    """CPU version of ``tensor_parallel.random._get_cuda_rng_state``."""
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    """CPU version of ``tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """CPU version of ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (same contract)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in params if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _tensor_cuda_is_noop(method: Any) -> Any:
    """Wrap a Megatron method so ``tensor.cuda()`` inside it leaves the tensor on the CPU."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *_a, **_k: self  # only for the duration of this call
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    wrapped.__name__ = method.__name__
    wrapped.__doc__ = method.__doc__
    return wrapped


def _frozen_linear_backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
    """``LinearWithFrozenWeight.backward`` with the input gradient as one 2-D matmul."""
    (weight,) = ctx.saved_tensors
    flat = grad_output.reshape(-1, grad_output.shape[-1]).matmul(weight)
    grad_input = flat.view(*grad_output.shape[:-1], weight.shape[1])
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    return grad_input, None, None, None, None


def _check_version() -> None:
    from megatron.core import package_info

    if package_info.__version__ != SUPPORTED_MEGATRON_VERSION:
        raise RuntimeError(
            f"CPU patches are written for megatron-core {SUPPORTED_MEGATRON_VERSION}, "
            f"found {package_info.__version__}"
        )


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU if CUDA is absent. Idempotent; returns True when patched."""
    global _APPLIED
    if _APPLIED:
        return True
    if cuda_available():
        return False
    _check_version()
    with _eager_jit_fuser():
        _patch()
    _APPLIED = True
    return True


@contextlib.contextmanager
def _eager_jit_fuser() -> Iterator[None]:
    """Import megatron-core with ``torch.compile`` as the identity. ``megatron.core.jit`` sets ``jit_fuser =
    torch.compile`` and decorates its fused kernels with it at import, which imports torch._dynamo and
    torch._inductor: 1.1 s of a 2.3 s import in every trainer rank. On CPU none of those kernels is used (the bias
    fusions are off), and where one were it would run eagerly instead of compiling with inductor on its first call.
    Only the import sees the identity; ``torch.compile`` is restored after it."""
    real = torch.compile

    def identity(model: Any = None, **_: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real  # type: ignore[assignment]


def _patch() -> None:
    from megatron.core import utils as core_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import router as moe_router

    cpu_torch = _CpuTorch()
    # GlobalMemoryBuffer.get_tensor: torch.empty(..., device=torch.cuda.current_device()).
    core_utils.torch = cpu_torch
    # RotaryEmbedding.__init__/get_emb: inv_freq moved to torch.cuda.current_device().
    rotary_pos_embedding.torch = cpu_torch
    # _gather_along_last_dim (TP logits gather) and the other TP gathers / reduce-scatters:
    # torch.empty(..., device=torch.cuda.current_device()).
    mappings.torch = cpu_torch
    # get_default_causal_mask / get_sliding_window_causal_mask: torch.ones(..., device="cuda")
    # (reached only when no explicit attention mask is passed; model.forward_logits passes one).
    transformer_utils.torch = cpu_torch
    # Router.gating (MoE): moves the router's weight to torch.cuda.current_device() on every forward.
    moe_router.torch = cpu_torch
    # RouterGatingLinearFunction reads moe_utils.te_general_gemm, which only a TransformerEngine import defines
    # (without TE: NameError); None selects its torch.mm branch.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # _ParamAndGradBuffer.__init__ (Megatron DDP): grad/param buffers allocated on
    # torch.cuda.current_device().
    param_and_grad_buffer.torch = cpu_torch
    # Pipeline parallelism: P2PCommunicator allocates received activations and shapes on
    # torch.cuda.current_device() and calls torch.cuda.synchronize() after batched sends; the 1F1B
    # schedule counts tokens in torch.zeros(..., device="cuda").
    p2p_communication.torch = cpu_torch
    schedules.torch = cpu_torch
    # get_grad_norm_fp32 / count_zeros_fp32: torch.zeros/tensor(..., device='cuda').
    clip_grads.torch = cpu_torch
    # FP32Optimizer.__init__ / MixedPrecisionOptimizer.__init__: _scale, found_inf on device='cuda'.
    optimizer.torch = cpu_torch
    # clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor'.
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    # LanguageModule.setup_embeddings_and_output_layer (tied embeddings with PP > 1):
    # weight.data.cuda() before the first/last-stage all-reduce.
    LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_is_noop(
        LanguageModule.setup_embeddings_and_output_layer)
    # CheckpointFunction / CheckpointWithoutOutput (activation recompute) save and restore the
    # RNG with _get_cuda_rng_state / _set_cuda_rng_state (torch.cuda.get_rng_state underneath).
    tp_random._get_cuda_rng_state = _get_rng_state
    tp_random._set_cuda_rng_state = _set_rng_state
    # CudaRNGStatesTracker.add: torch.cuda.manual_seed / torch.cuda.get_rng_state; its fork would
    # also warn on every forward once the CPU generator is the one being forked.
    tracker_cls = type("CpuRNGStatesTracker", (CpuRNGStatesTracker, tp_random.CudaRNGStatesTracker), {})
    tp_random.CudaRNGStatesTracker = tracker_cls
    tp_random.initialize_rng_tracker(force_reset=True)
    # LinearWithFrozenWeight.backward (every linear of a LoRA job's frozen base): grad_output.matmul(weight) on the
    # 3-D, non-contiguous gradient, which CPU torch runs as a batched bmm over the broadcast weight: a SmolLM2 LoRA
    # step took 1.4x a full step's time (bmm 2.5 s of it) and its adapter gradients were 1.2e-4 (relative) from
    # float64's, against 1e-5 for the same math as one 2-D mm.
    tp_layers.LinearWithFrozenWeight.backward = staticmethod(_frozen_linear_backward)
