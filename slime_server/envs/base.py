"""The environment interface: a dataset row in, messages + tools out, tool calls answered, a reward.

Why this small: an environment only knows its task. Everything else (sessions, sampling, groups,
rewards over REST, retries) is the agent runner's job, so the same environment drives training
jobs, evaluation and standalone runs against any slime-server. Users add their own with one class
(``Environment`` subclass) or a function path; ``get_environment("pkg.module:Name")`` loads it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field


class DatasetRow(BaseModel):
    """slime's JSONL row: ``prompt`` (text or chat messages), ``label``, ``metadata``."""

    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class ToolOutput(BaseModel):
    """A tool's answer with images (a screenshot, a rendered chart): the text goes in the tool message, each image
    (PNG or JPEG bytes) to a vision-language model beside it (the runner sends them in a user message after the tool
    results, as OpenAI's Chat Completions carries a tool's images)."""

    text: str
    images: list[bytes] = Field(default_factory=list)


class EpisodeState(BaseModel):
    """What an episode carries between steps (environments may keep more in ``scratch``)."""

    row: DatasetRow
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: int = 0
    scratch: dict[str, Any] = Field(default_factory=dict)


class Environment(ABC):
    """One task family. ``reset`` -> ``step`` on each tool call -> ``reward`` of the final answer."""

    name: str = "env"
    system_prompt: str | None = None
    max_turns: int = 4

    @abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI function tools (JSON Schema parameters)."""

    def reset(self, row: DatasetRow) -> EpisodeState:
        messages = list(row.prompt) if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        if self.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return EpisodeState(row=row, messages=messages, tools=self.tools())

    @abstractmethod
    def call_tool(self, state: EpisodeState, name: str, arguments: dict[str, Any]) -> str | ToolOutput:
        """The tool's answer (text for the ``tool`` message, or a ``ToolOutput`` with images); errors are answers
        too, never raises."""

    def step(self, state: EpisodeState, name: str, arguments_json: str) -> str | ToolOutput:
        """Parse arguments and dispatch; a malformed call gets an error message the model can read."""
        state.tool_calls += 1
        if name not in {t["function"]["name"] for t in state.tools}:
            return f"error: unknown tool {name!r}"
        try:
            arguments = json.loads(arguments_json or "{}")
        except json.JSONDecodeError as e:
            return f"error: arguments are not JSON ({e.msg})"
        if not isinstance(arguments, dict):
            return "error: arguments must be a JSON object"
        return self.call_tool(state, name, arguments)

    @abstractmethod
    def reward(self, state: EpisodeState, final_text: str) -> float:
        """Reward of the episode given the model's final answer."""

    def default_dataset(self, n: int, seed: int = 0) -> list[DatasetRow]:
        """Synthetic rows when no dataset is given (built-in environments generate their own)."""
        raise NotImplementedError(f"environment {self.name!r} needs a dataset")


BUILTIN: dict[str, str] = {
    "calculator": "slime_server.envs.calculator:CalculatorEnv",
    "search": "slime_server.envs.search:SearchEnv",
    "python": "slime_server.envs.python_env:PythonEnv",
    "mcp": "slime_server.envs.mcp:MCPEnvironment",  # needs command=[...]
    "shapes": "slime_server.envs.shapes:ShapesEnv",  # a vision-language model's: look returns a picture
}


def get_environment(name: str, **kwargs: Any) -> Environment:
    """A built-in name or ``module:attr`` (a class, or a function returning an Environment)."""
    ref = BUILTIN.get(name, name)
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ValueError(f"unknown environment {name!r}: built-ins are {sorted(BUILTIN)}, or give module:attr")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:  # ValueError: an empty module name
        raise ValueError(f"environment {name!r}: cannot load {ref!r} ({e})") from e
    try:
        env = obj(**kwargs)
    except Exception as e:  # the user's class refusing these arguments is a bad spec, not a server error
        raise ValueError(f"environment {name!r}: {ref} could not be built ({type(e).__name__}: {e})") from e
    if not isinstance(env, Environment):
        raise ValueError(f"{ref} did not produce an Environment")
    return env


def load_jsonl(path: str | Path) -> list[DatasetRow]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(DatasetRow.model_validate_json(line))
                except ValueError as e:
                    raise ValueError(f"{path}:{i}: not a dataset row ({e})") from e
    return rows


def verifiers_module(env_id: str) -> str:
    """verifiers' rule for an environment id: a hub id ``owner/name@version`` is the installed module ``name``
    (``-`` as ``_``); a module path is itself. Checked at submit time without importing verifiers (seconds):
    an environment that is not installed is a 400 that says so."""
    name = env_id.split("@", 1)[0].split("/")[-1].replace("-", "_")
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or an empty name
        found = False
    if not found:
        raise ValueError(f"verifiers environment {env_id!r} is not installed (no module {name!r}): pip install it "
                         "(or `prime env install` a hub id) on the server")
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError("data.source 'verifiers' needs the verifiers package on the server: "
                         "pip install 'slime-server[verifiers]'")
    return name
