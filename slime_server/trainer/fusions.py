"""Megatron's fusions stay eager on CPU, and importing Megatron stops loading torch's compiler.

Why: ``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and every module that decorates a fusion with
it (bias-GeLU, bias-dropout-add, SwiGLU, ...) makes torch import dynamo and inductor at import time: ~1.4 s
of every trainer rank's start on this 2-core machine, for kernels the CPU path never calls (no inductor
compile ever happens here: its cache directory stays empty). So, when CUDA is absent, ``megatron.core.jit``
runs with ``torch.compile`` standing in as the identity: ``jit_fuser`` is a no-op decorator, as Megatron's
own ``disable_jit_fuser`` makes it, but from the start, before any module has bound the compiling one. With
CUDA, nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_JIT = "megatron.core.jit"


def _identity(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing: ``@jit_fuser`` and ``jit_fuser(fn)`` return ``fn``."""
    return fn if fn is not None else (lambda f: f)


class _EagerFusions(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` once, and runs it with ``torch.compile`` as the identity when CUDA is absent."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != _JIT:
            return None
        sys.meta_path.remove(self)  # one module, once; the real finders locate it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            import torch  # lazy: the finder is installed by a package that must not load torch for it

            if torch.cuda.is_available():
                run(module)
                return
            real, torch.compile = torch.compile, _identity  # type: ignore[assignment]
            try:
                run(module)
            finally:
                torch.compile = real

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Before Megatron's first import (``trainer/__init__.py``); nothing once ``megatron.core.jit`` is loaded."""
    if _JIT not in sys.modules and not any(isinstance(f, _EagerFusions) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerFusions())
