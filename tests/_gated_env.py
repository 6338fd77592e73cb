"""A calculator whose episodes wait at ``reset`` until the test opens ``GATE``: it holds an evaluation round in
progress for exactly as long as a test needs (no sleep, no timing margin in the code under test). Named in a job
spec as ``tests._gated_env:GatedCalculator``; the server runs in the test's process, so the test and the job see
the same ``GATE``."""

from __future__ import annotations

import threading

from slime_server.envs.base import DatasetRow, EpisodeState
from slime_server.envs.calculator import CalculatorEnv

GATE = threading.Event()
ENTERED = threading.Event()  # an episode is waiting at the gate


class GatedCalculator(CalculatorEnv):
    name = "gated-calculator"

    def reset(self, row: DatasetRow) -> EpisodeState:
        ENTERED.set()
        if not GATE.wait(600):
            raise TimeoutError("the test never opened the gate")
        return super().reset(row)
