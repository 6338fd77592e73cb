"""Which cores of this host the CPU engines and a job's trainer ranks run on, by default.

Why: on a CPU host engines and trainer ranks share cores unless told otherwise, and each then slows the other
(``utils/affinity.py``); while no job trains, cores left to a trainer that is not running sit idle. So unless
``engine.cpus``/``engine.torch_threads`` (or ``trainer.cpus``/``trainer.torch_threads``) fix them by hand:

- the engines get all of the host's cores while no job trains, each engine a contiguous share of them;
- while a job's ranks run, they get the upper half of the cores (at least one; the ranks split it), and the
  engines share the rest (all of them on a one-core host);
- the CPU engine follows its cores with its torch thread count (``rollout/core_follow.py``); the ranks get one
  thread per core of theirs.

Only for a cluster this process starts (a local one): engines on other nodes keep the cores they started with.
"""

from __future__ import annotations

from slime_server.config import EngineSettings, TrainerSettings
from slime_server.utils.affinity import host_cores, slices


class CoreShare:
    """The default placement (see the module's docstring); ``training`` counts the jobs whose ranks run."""

    def __init__(self, engine: EngineSettings, trainer: TrainerSettings, *, local: bool,
                 cores: list[int] | None = None) -> None:
        self.cores = sorted(cores) if cores is not None else host_cores()
        self.auto_engines = local and engine.kind == "cpu" and engine.cpus is None and engine.torch_threads is None
        self.auto_trainer = (local and trainer.cpus is None and trainer.torch_threads is None
                             and not trainer.colocate and trainer.num_gpus_per_rank == 0)
        self.fixed_trainer = trainer.cpus if local and not trainer.colocate else None
        self.num_ranks = trainer.num_ranks
        self.training = 0

    def trainer_cores(self) -> list[int] | None:
        """The cores a job's ranks run on (None: wherever the settings leave them)."""
        if not self.auto_trainer:
            return self.fixed_trainer
        half = max(1, len(self.cores) // 2)
        return self.cores[len(self.cores) - half:]

    def trainer_threads(self) -> int | None:
        """Each rank's torch threads by default: its share of the trainer's cores."""
        cores = self.trainer_cores() if self.auto_trainer else None
        return max(1, len(cores) // self.num_ranks) if cores else None

    def engine_cores(self, num_engines: int) -> list[list[int]] | None:
        """Each local CPU engine's cores now (None: the settings fix them, or no engine follows this)."""
        if not self.auto_engines or num_engines <= 0:
            return None
        pool = self.cores
        held = set(self.trainer_cores() or []) if self.training else set()
        if held and any(c not in held for c in pool):
            pool = [c for c in pool if c not in held]
        return slices(pool, num_engines)
