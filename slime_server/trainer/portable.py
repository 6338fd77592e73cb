"""A checkpoint's layout-free part: what lets a job resume on another TP x PP layout (resharding).

The per-rank files of ``checkpoint.py`` restore bit-identically but only onto the layout that wrote them. Beside
them, rank 0 writes ``portable.pt``: every parameter and its two Adam moments as full tensors under Megatron's
global names (TP shards gathered, pipeline stages merged, layer numbers global), the Adam step and the LR
schedule. Loading it on any layout is the same split the HF loader does (``convert.megatron_shards``), applied
to the weights and to each moment, so the next step is the step the old layout would have taken (up to float
rounding in the sharded matmuls; RNG streams are per rank and are not carried over: the models here have no
dropout).

Why our own and not Megatron's ``dist_checkpointing``: the trainer's optimizer is Megatron's plain (not
distributed) Adam over fp32 parameters, whose moments map one to one onto the parameters, so the HF conversion
code that is already tested on every layout does the resharding; a model too large to gather on one rank should
turn it off (``TrainerRankSettings.portable_checkpoints``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from slime_server.trainer.convert import gather_tp, global_parameter_names, megatron_shards
from slime_server.trainer.model import unwrap
from slime_server.trainer.optimizer import OptimizerBundle
from slime_server.trainer.pipeline import gather_stages

PORTABLE_FILE = "portable.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")


class NotPortable(RuntimeError):
    """This optimizer's state cannot be written layout-free (e.g. bf16 params with fp32 main copies)."""


def _torch_optimizers(bundle: OptimizerBundle) -> list[Any]:
    chained = getattr(bundle.optimizer, "chained_optimizers", None) or [bundle.optimizer]
    return [c.optimizer for c in chained]


def adam_state_of(bundle: OptimizerBundle) -> dict[int, tuple[Any, nn.Parameter]]:
    """id(model parameter) -> (the torch optimizer holding it, the parameter); NotPortable when the optimizer steps
    copies of the parameters rather than the parameters themselves."""
    held = {id(p): (opt, p) for opt in _torch_optimizers(bundle) for g in opt.param_groups for p in g["params"]}
    params = list(unwrap(bundle.model).parameters())
    if any(id(p) not in held for p in params if p.requires_grad):
        raise NotPortable("the optimizer does not step the model's own parameters (bf16 with fp32 main params?)")
    return held


def full_state(bundle: OptimizerBundle) -> dict[str, dict[str, torch.Tensor]] | None:
    """{"weights" | "exp_avg" | "exp_avg_sq": {global Megatron name: full tensor}} on rank 0 (collective: every
    rank calls it; None elsewhere)."""
    import torch.distributed as dist

    held = adam_state_of(bundle)
    inner = unwrap(bundle.model)
    out: dict[str, dict[str, torch.Tensor]] = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for key, param in global_parameter_names(inner):
        if not param.requires_grad:
            continue  # frozen (a LoRA job's base): the HF checkpoint the job starts from
        opt, _ = held[id(param)]
        state = opt.state.get(param, {})
        for part in out:
            local = (param if part == "weights" else state.get(part, torch.zeros_like(param))).detach()
            out[part][key] = gather_tp(key, param, local).to("cpu", copy=True)
    merged = {part: gather_stages(tensors) for part, tensors in out.items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    return merged if rank == 0 else None


def adam_step(bundle: OptimizerBundle) -> float:
    """Adam's step count (the same for every parameter; 0 before the first step)."""
    for opt in _torch_optimizers(bundle):
        for state in opt.state.values():
            return float(state["step"])
    return 0.0


def save_portable(directory: Path, bundle: OptimizerBundle) -> None:
    """Write ``portable.pt`` into ``directory`` (collective; rank 0 writes)."""
    state = full_state(bundle)
    if state is not None:
        torch.save({**state, "adam_step": adam_step(bundle), "scheduler": bundle.scheduler.state_dict(),
                    "slot_steps": bundle.slot_steps}, directory / PORTABLE_FILE)


def load_portable(directory: Path, bundle: OptimizerBundle) -> None:
    """This rank's shards of ``portable.pt``: weights, Adam moments and step, the LR schedule."""
    if not (directory / PORTABLE_FILE).is_file():
        raise FileNotFoundError(f"{directory} has no {PORTABLE_FILE}: it was written for one layout only")
    saved = torch.load(directory / PORTABLE_FILE, map_location="cpu", weights_only=True)
    held = adam_state_of(bundle)
    inner = unwrap(bundle.model)
    moments = {part: dict(megatron_shards(inner, saved[part], trainable_only=True)) for part in MOMENTS}
    with torch.no_grad():
        for param, shard in megatron_shards(inner, saved["weights"], trainable_only=True):
            param.copy_(shard)
            opt, _ = held[id(param)]
            prior = opt.state.get(param, {})
            step = prior.get("step")
            opt.state[param] = {
                "step": torch.tensor(saved["adam_step"], dtype=step.dtype if step is not None else torch.float32),
                **{part: moments[part][param].to(param.device, param.dtype).clone() for part in MOMENTS}}
    bundle.scheduler.load_state_dict(saved["scheduler"])
    bundle.slot_steps = saved.get("slot_steps")
