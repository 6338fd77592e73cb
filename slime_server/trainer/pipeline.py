"""Pipeline parallelism (PP > 1) for the train step and the log-prob pass, through Megatron's own schedule.

Why Megatron's schedule and not ours: the 1F1B order, the p2p exchange of activations and their gradients
between stages, and what a stage keeps alive are what the GPU path runs; on CPU the same schedule runs over
gloo (``megatron_cpu.py`` points its device requests at the CPU). Every rank packs the same micro-batches
(the packing is a pure function of the global batch), so each stage knows them without sending data: the
first stage embeds the tokens, every stage builds the attention mask and RoPE positions from the position
ids, and the last stage scores the tokens. Packed rows differ in length, so the schedule exchanges shapes
first (``config.variable_seq_lengths``).

What the last stage computes (loss, metrics, log-probs) is broadcast to the other stages of its pipeline, so
every rank returns the same answer, as with PP = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from slime_server.trainer.convert import iter_hf_tensors
from slime_server.trainer.model import forward_micro_batch
from slime_server.trainer.packing import MicroBatch

if TYPE_CHECKING:
    from slime_server.trainer.convert import Staging


def pipeline_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return pipeline_size() == 1 or ps.is_pipeline_last_stage()


def run_schedule(model: nn.Module, micro_batches: Sequence[MicroBatch],
                 on_output: Callable[[MicroBatch, torch.Tensor], torch.Tensor], *, forward_only: bool) -> None:
    """Run every micro-batch through the pipeline with Megatron's schedule (1F1B; forward-only for scoring).

    ``on_output(mb, local_logits)`` runs on the last stage with that micro-batch's logits [T, vocab / tp] (in the
    samples' layout: a micro-batch with a token tree runs its R rows through the stages, then expands them) and
    returns the scalar whose gradient the step wants; Megatron divides what the loss function returns by the
    number of micro-batches, so it is multiplied back here: the caller's loss is already normalised over the
    global batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    config.variable_seq_lengths = True  # packed rows have their own lengths: exchange shapes first
    n = len(micro_batches)

    def forward_step(data_iterator: Any, stage_model: nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
        mb = next(data_iterator)
        out = forward_micro_batch(stage_model, mb)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return on_output(mb, mb.expand(output[0])) * n, {}

        return out, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model], num_microbatches=n,
        seq_length=max(mb.num_rows for mb in micro_batches), micro_batch_size=1, forward_only=forward_only)


def from_last_stage(value: Any) -> Any:
    """``value`` as the last pipeline stage has it, on every stage of this pipeline (identity for PP = 1)."""
    from megatron.core import parallel_state as ps

    if pipeline_size() == 1:
        return value
    box = [value if ps.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]


def gather_stages(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's HF-named tensors merged, on every stage (small models: tests, CPU exports)."""
    from megatron.core import parallel_state as ps

    if pipeline_size() == 1:
        return named
    parts: list[Any] = [None] * pipeline_size()
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in named.items()},
                           group=ps.get_pipeline_model_parallel_group())
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def pipeline_hf_tensors(model: nn.Module, staging: Staging | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's HF-named tensors on the push sender (first stage, TP rank 0, DP rank 0), streamed stage
    by stage: each later stage's TP rank 0 of DP rank 0 sends its tensors to its pipeline's first rank, a header
    (name, or None at the stage's end) then the tensor. Every other rank takes part in its own stage's TP
    gathers and yields only what it holds (it sends to the engines nothing: ``is_push_sender``)."""
    from megatron.core import parallel_state as ps

    if pipeline_size() == 1:
        yield from iter_hf_tensors(model, staging)
        return
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)  # global ranks of this pipeline's stages, in order
    first = ranks[0]
    pp_rank = ps.get_pipeline_model_parallel_rank()
    relay = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    for stage in range(pipeline_size()):
        if stage == pp_rank:
            for name, tensor in iter_hf_tensors(model, staging if stage == 0 else None):
                if stage == 0:
                    yield name, tensor
                elif relay:
                    t = tensor.detach().contiguous()
                    dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=first, group=group)
                    dist.send(t, dst=first, group=group)
            if stage > 0 and relay:
                dist.send_object_list([None], dst=first, group=group)
        elif pp_rank == 0 and relay:  # the sender: receive this stage's tensors
            src = ranks[stage]
            while True:
                header: list[Any] = [None]
                dist.recv_object_list(header, src=src, group=group)
                if header[0] is None:
                    break
                name, shape, dtype = header[0]
                t = torch.empty(shape, dtype=dtype, device=next(model.parameters()).device)
                dist.recv(t, src=src, group=group)
                yield name, t

