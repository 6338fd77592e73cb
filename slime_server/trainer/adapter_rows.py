"""Which adapter each row of the forward goes through, in a multi-adapter LoRA trainer (one adapter per user).

Why a context variable: ``model.forward_micro_batch`` knows the rows (from the packed micro-batch) and the
adapters' forward hooks (``lora.LoRABranch``) need them, but the model module sits below lora.py in the imports;
this small module is what both read. None: every row goes through adapter 0 (a one-adapter trainer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_ROWS: ContextVar[torch.Tensor | None] = ContextVar("adapter_rows", default=None)


def current() -> torch.Tensor | None:
    """The adapter index of every row of the forward running now (long [R]), or None."""
    return _ROWS.get()


@contextmanager
def rows_through(rows: torch.Tensor | None) -> Iterator[None]:
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)
