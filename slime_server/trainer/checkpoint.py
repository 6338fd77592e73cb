"""Save / resume a trainer: model, optimizer, LR schedule, RNG streams, step, policy version.

Layout of a checkpoint directory (one per save, e.g. ``<root>/step_00000010``)::

    meta.json          CheckpointMeta (written last, by rank 0; its presence marks a complete save)
    rank_00000.pt      torch.save of RankState for global rank 0
    rank_00001.pt      ... one file per rank (TP shard / PP stage / DP replica)

Why per-rank ``torch.save`` instead of Megatron's distributed checkpointing: the trainer's
world is small and fixed between save and resume, and a plain file per rank is simple to
inspect. Atomicity: every rank writes into ``<dir>.tmp``; after a barrier rank 0 writes
``meta.json`` and renames the temp dir into place, so a crash never leaves a half-written
checkpoint under the final name. Resuming with the same world layout gives bit-identical
next steps on CPU (all RNG streams, Adam moments and the scheduler count are restored); another layout
reshards from ``portable.pt`` when the save wrote one (``trainer/portable.py``).
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field

from slime_server.trainer.model import unwrap
from slime_server.trainer.optimizer import OptimizerBundle
from slime_server.trainer.portable import PORTABLE_FILE, load_portable, save_portable

META_FILE = "meta.json"
_STEP_PREFIX = "step_"


class CheckpointMeta(BaseModel):
    """Describes a complete checkpoint; checked against the loading world before any tensor is read."""

    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    world_size: int = Field(ge=1)
    tp_size: int = Field(ge=1)
    pp_size: int = Field(ge=1)
    megatron_version: str
    created_at: float
    extra: dict[str, Any] = Field(default_factory=dict)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _parallel_sizes() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 1
    return ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()


def _frozen_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def trained_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict without its frozen parameters (a LoRA job's base: it is the HF checkpoint the job
    starts from, loaded again on resume); the whole state dict when everything trains."""
    frozen = _frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_trained_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Inverse of ``trained_state``: every trained tensor must be there, and nothing else."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - _frozen_names(model):
        raise ValueError(f"checkpoint does not fit this model: missing {sorted(set(missing) - _frozen_names(model))[:5]}"
                         f", unexpected {sorted(unexpected)[:5]} (a LoRA checkpoint needs the same lora settings)")


def capture_rng() -> dict[str, Any]:
    """Every RNG stream a training step can touch (CPU, CUDA, Megatron's model-parallel tracker)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch_cpu": torch.get_rng_state(),
        "megatron_tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Conventional directory for the checkpoint taken after ``step`` steps."""
    return Path(root) / f"{_STEP_PREFIX}{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.glob(f"{_STEP_PREFIX}*") if p.is_dir() and (p / META_FILE).is_file()]
    return max(done, key=lambda p: p.name, default=None)


def read_meta(path: str | Path) -> CheckpointMeta:
    """Metadata of a complete checkpoint; FileNotFoundError if the save never finished."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META_FILE})")
    return CheckpointMeta.model_validate_json(meta_path.read_text())


def save_checkpoint(
    path: str | Path, bundle: OptimizerBundle, *, step: int, policy_version: int,
    extra: dict[str, Any] | None = None, portable: bool = False,
) -> Path:
    """Write this rank's state into ``path`` (collective: every rank must call it). Returns ``path``.

    ``portable``: also the layout-free ``portable.pt`` (``trainer/portable.py``), so the checkpoint can be
    resumed on another TP x PP layout."""
    from megatron.core import package_info

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = {
        "model": trained_state(unwrap(bundle.model)),
        "optimizer": bundle.optimizer.state_dict(),
        "scheduler": bundle.scheduler.state_dict(),
        "rng": capture_rng(),
        "slot_steps": bundle.slot_steps,
    }
    torch.save(state, tmp / f"rank_{rank:05d}.pt")
    if portable:
        save_portable(tmp, bundle)
    _barrier()
    if rank == 0:
        tp, pp = _parallel_sizes()
        meta = CheckpointMeta(
            step=step, policy_version=policy_version, world_size=_world(), tp_size=tp, pp_size=pp,
            megatron_version=package_info.__version__, created_at=time.time(), extra=extra or {},
        )
        (tmp / META_FILE).write_text(meta.model_dump_json(indent=2))
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    _barrier()
    return final


def load_checkpoint(path: str | Path, bundle: OptimizerBundle) -> CheckpointMeta:
    """Restore this rank's state from ``path`` into ``bundle``: bit-identically from its own rank file when the
    layout is the one that saved it, else resharded from the checkpoint's ``portable.pt``."""
    meta = read_meta(path)
    tp, pp = _parallel_sizes()
    if (meta.world_size, meta.tp_size, meta.pp_size) != (_world(), tp, pp):
        if not (Path(path) / PORTABLE_FILE).is_file():
            raise ValueError(
                f"checkpoint layout world={meta.world_size} tp={meta.tp_size} pp={meta.pp_size} does not "
                f"match this run (world={_world()} tp={tp} pp={pp}) and it has no {PORTABLE_FILE} to reshard "
                "from (saved with portable checkpoints off); convert via HF weights instead")
        load_portable(Path(path), bundle)
        return meta
    state = torch.load(Path(path) / f"rank_{_rank():05d}.pt", map_location="cpu", weights_only=True)
    load_trained_state(unwrap(bundle.model), state["model"])
    bundle.optimizer.load_state_dict(state["optimizer"])
    bundle.scheduler.load_state_dict(state["scheduler"])
    bundle.slot_steps = state.get("slot_steps")
    restore_rng(state["rng"])
    return meta

