"""Import a script of ``tools/`` (not a package) as a module, for the tests that drive benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(script: str) -> ModuleType:
    """``tools/<script>`` as module ``<script stem>``, registered so its own sibling imports resolve."""
    name = script.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, TOOLS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
