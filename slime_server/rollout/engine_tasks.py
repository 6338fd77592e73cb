"""Work handed to the CPU engine's scheduler thread, which alone computes with the model (cpu_engine.py): a function
to run between two steps, and a weight update to apply there atomically."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class SchedulerTask:
    """A function handed to the scheduler thread (``run_on_scheduler``)."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed back to the caller
            self.error = e
        self.done.set()


@dataclass(eq=False)
class WeightCommit:
    """One weight update handed to the scheduler thread."""

    named: list[tuple[str, torch.Tensor]]
    version: str | None
    flush: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
