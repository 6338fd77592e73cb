"""Shared fixtures: the tiny model is built once per machine (cached, process-safe)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from slime_server.models.tiny import ensure_tiny_model

    return ensure_tiny_model()
