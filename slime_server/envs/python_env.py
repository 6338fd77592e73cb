"""``python``: the model writes Python; a sandbox runs it; the row's tests decide the reward.

Tool ``python(code)`` runs a snippet and returns its stdout/stderr, so the model can try things.
The final answer is the last ```python fenced block of the model's last message (or the whole
message); reward 1 if that code followed by the row's ``label`` tests (asserts) exits 0 in the
sandbox within the limits, else 0.
"""

from __future__ import annotations

import random
import re
from typing import Any

from slime_server.envs.base import DatasetRow, Environment, EpisodeState
from slime_server.envs.sandbox import run_python

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)

TASKS = [
    ("Write a Python function add(a, b) that returns a + b.", "assert add(2, 3) == 5\nassert add(-1, 1) == 0"),
    ("Write a Python function square(x) that returns x squared.", "assert square(4) == 16\nassert square(-3) == 9"),
    ("Write a Python function is_even(n) that returns True if n is even.",
     "assert is_even(4) is True\nassert is_even(7) is False"),
    ("Write a Python function reverse(s) that returns the string s reversed.",
     "assert reverse('abc') == 'cba'\nassert reverse('') == ''"),
    ("Write a Python function maximum(xs) that returns the largest number in the list xs.",
     "assert maximum([3, 9, 2]) == 9\nassert maximum([-5]) == -5"),
]


def extract_code(text: str) -> str:
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


class PythonEnv(Environment):
    name = "python"
    system_prompt = "Write Python code. You may run code with the python tool. Give the final code in a ```python block."
    max_turns = 4

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512) -> None:
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {
            "name": "python", "description": "Run Python code (no network, no files outside a temp dir); "
                                             "returns stdout and stderr.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]

    def call_tool(self, state: EpisodeState, name: str, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return "error: 'code' must be a string"
        r = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if r.timed_out:
            return f"error: timed out after {self.timeout_s:g}s"
        return (r.stdout + (f"\n[stderr]\n{r.stderr}" if r.stderr else "")).strip() or "(no output)"

    def reward(self, state: EpisodeState, final_text: str) -> float:
        program = extract_code(final_text) + "\n\n" + str(state.row.label or "")
        return float(run_python(program, timeout_s=self.timeout_s, memory_mb=self.memory_mb).ok)

    def default_dataset(self, n: int, seed: int = 0) -> list[DatasetRow]:
        rng = random.Random(seed)
        return [DatasetRow(prompt=p, label=t) for p, t in (rng.choice(TASKS) for _ in range(n))]
