"""torch.distributed + Megatron ``parallel_state`` setup for trainer ranks.

One entry point for every trainer process: in-process world size 1 for tests and tools,
or torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) for
multi-process jobs. gloo on CPU (the CPU patches are applied first), nccl on GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime_server.trainer.megatron_cpu import apply_cpu_patches, cuda_available


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: sizes and ranks of the TP / PP / DP groups."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int


def open_rendezvous(world_size: int, timeout_s: float = 600.0, host: str = "0.0.0.0") -> dist.TCPStore:
    """Rank 0's rendezvous store, listening from now on, on a port the OS picks (``.port``). Why not a free port
    chosen first and bound at ``init_process_group``: another process on the host can take it in between (seen:
    EADDRINUSE when two test workers started trainer groups at once)."""
    from datetime import timedelta

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def _init_process_group(backend: str, timeout_s: float, store: dist.TCPStore | None = None) -> None:
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if store is None and world > 1:  # a rank joining rank 0's store (torchrun's env vars; rank 0 under torchrun)
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        return
    if store is None:  # alone: a store of our own, no port to agree on
        store = open_rendezvous(1, timeout_s, "127.0.0.1")
    # as init_method="env://" does for the other ranks, so their keys meet ours
    dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store),
                            rank=int(os.environ.get("RANK", "0")), world_size=world, timeout=timeout)


def init_parallel(
    tp_size: int = 1, pp_size: int = 1, *, seed: int = 1234, backend: str | None = None,
    timeout_s: float = 600.0, store: dist.TCPStore | None = None, ep_size: int = 1,
) -> ParallelLayout:
    """Initialise torch.distributed (if needed) and Megatron's TP/PP/DP groups; seed RNGs.

    DP size is whatever is left: world_size / (tp_size * pp_size); an MoE model's experts split over ``ep_size``
    of the DP ranks (expert parallelism, carved out of DP as Megatron does). ``store``: rank 0's ``open_rendezvous``
    (the other ranks join it by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
    """
    from megatron.core import parallel_state, tensor_parallel

    on_gpu = cuda_available()
    if not on_gpu:
        apply_cpu_patches()
    elif "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        _init_process_group(backend or ("nccl" if on_gpu else "gloo"), timeout_s, store)
    world = dist.get_world_size()
    if world % (tp_size * pp_size) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp_size * pp_size}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        expert_model_parallel_size=ep_size,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return current_layout()


def current_layout() -> ParallelLayout:
    """This rank's position in the initialised Megatron groups."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(), rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def parallel_context(tp_size: int = 1, pp_size: int = 1, *, seed: int = 1234, ep_size: int = 1
                     ) -> Iterator[ParallelLayout]:
    """``init_parallel`` for the duration of a block (tests, conversion tools)."""
    layout = init_parallel(tp_size, pp_size, seed=seed, ep_size=ep_size)
    try:
        yield layout
    finally:
        destroy_parallel()
