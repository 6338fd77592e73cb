"""Where a job's scalars go besides the job store: TensorBoard event files, and W&B when asked.

Why one fan-out object (``JobLog``): the loop's steps and the evaluator's rounds write each scalar
once and every sink gets the same names and steps. W&B is optional: ``wandb`` is imported only by a
job whose spec has a ``wandb`` section, and a server without the package refuses such a job at
submit time (400) instead of training without the logs that were asked for.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class WandbSpec(BaseModel):
    """``JobSpec.wandb``: log the job's metrics to a W&B run (id = job id, resumed after a restart)."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(min_length=1, max_length=128, description="W&B project")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline writes the run under the job's directory (`wandb sync` uploads it later)")
    entity: str | None = Field(None, description="team or user; default: the logged-in user's")
    name: str | None = Field(None, description="run name; default: the job's name, else its id")
    tags: list[str] = Field(default_factory=list)


class WandbUnavailable(RuntimeError):
    """The job asks for W&B but the ``wandb`` package is not installed."""


def require_wandb() -> Any:
    """The ``wandb`` module, or ``WandbUnavailable`` with the fix in its message."""
    try:
        import wandb
    except ImportError as e:
        raise WandbUnavailable("this job asks for W&B logging (job.wandb) but the wandb package is not installed "
                               "on the server: pip install 'slime-server[wandb]'") from e
    return wandb


class JobLog:
    """``add_scalar`` / ``add_scalars`` / ``flush`` / ``close`` over the sinks that are open."""

    def __init__(self, tb: Any = None, run: Any = None) -> None:
        self.tb, self.run = tb, run
        self._lock = threading.Lock()  # the loop thread and the eval thread both log

    @classmethod
    def open(cls, job_dir: Path, job_id: str, *, name: str | None = None, wandb: WandbSpec | None = None,
             config: dict[str, Any] | None = None) -> JobLog:
        """TensorBoard under ``job_dir/tb``; a W&B run if ``wandb`` asks for one (its errors propagate)."""
        wanted = wandb is not None and wandb.mode != "disabled"
        return cls(_tensorboard(job_dir / "tb"), _wandb_run(wandb, job_dir, job_id, name, config) if wanted else None)

    def add_scalars(self, metrics: dict[str, float], step: int) -> None:
        with self._lock:
            if self.tb is not None:
                for k, v in metrics.items():
                    self.tb.add_scalar(k, v, step)
            if self.run is not None:
                self.run.log({**metrics, "step": step})

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.add_scalars({name: value}, step)

    def flush(self) -> None:
        with self._lock:
            if self.tb is not None:
                self.tb.flush()

    def close(self) -> None:
        with self._lock:
            if self.tb is not None:
                self.tb.close()
            if self.run is not None:
                try:
                    self.run.finish()
                except Exception:  # noqa: BLE001 - a logging backend must never fail the job's shutdown
                    log.exception("W&B run finish failed")
            self.tb = self.run = None


def _tensorboard(path: Path) -> Any:
    """A TensorBoard event-file writer (tensorboardX), or None if it is not installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        log.warning("tensorboardX is not installed: no TensorBoard event files")
        return None
    return SummaryWriter(str(path))


def _wandb_run(spec: WandbSpec, job_dir: Path, job_id: str, name: str | None, config: dict[str, Any] | None) -> Any:
    wandb = require_wandb()
    run = wandb.init(
        project=spec.project, entity=spec.entity, name=spec.name or name or job_id, tags=spec.tags or None,
        mode=spec.mode, id=job_id, resume="allow", dir=str(job_dir), config=config, reinit="create_new",
        # console="off": never wrap the server's stdout/stderr; silent: no banner in the server log
        settings=wandb.Settings(console="off", silent=True))
    run.define_metric("step")
    run.define_metric("*", step_metric="step")  # eval rounds land after later steps: plot against "step"
    return run
