"""A visual environment (issue 45): the answer is in a picture that a tool returns.

Each episode asks about one rendered picture (PIL: a coloured shape on a plain background, at a random place and
size); the model sees it only by calling ``look``, whose answer carries the image (``ToolOutput``), then answers in
``<answer></answer>``. The reward checks the answer against what was drawn: ``colour`` questions (which colour is
the shape) or ``shape`` questions (which shape). Small enough for the tiny VLM on 2 cores, checkable exactly, and
the same agent loop a computer-use agent runs (act, get a screenshot back, decide).
"""

from __future__ import annotations

import io
import random
import re
from typing import Any, Literal

from slime_server.envs.base import DatasetRow, Environment, EpisodeState, ToolOutput

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
SHAPES = ("square", "circle", "triangle")
ANSWER = re.compile(r"<answer>\s*([a-z]+)\s*</answer>", re.IGNORECASE)
QUESTIONS = {"colour": "What colour is the shape in the picture?", "shape": "What shape is in the picture?"}


def render(colour: str, shape: str, seed: int, size: int = 112) -> bytes:
    """The picture as PNG: ``shape`` in ``colour`` on a light background, its place and size from ``seed``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), tuple(rng.randint(225, 255) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    side = rng.randint(size // 3, size * 2 // 3)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    fill = COLOURS[colour]
    if shape == "square":
        draw.rectangle((x, y, x + side, y + side), fill=fill)
    elif shape == "circle":
        draw.ellipse((x, y, x + side, y + side), fill=fill)
    else:
        draw.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class ShapesEnv(Environment):
    """``look`` returns the picture; the reward is 1 for the right word in ``<answer></answer>``."""

    name = "shapes"
    max_turns = 3
    system_prompt = ("Answer questions about a picture. Call the look tool to see it, then give the answer as one "
                     "word in <answer></answer>.")

    def __init__(self, question: Literal["colour", "shape"] = "colour") -> None:
        if question not in QUESTIONS:
            raise ValueError(f"question must be one of {sorted(QUESTIONS)}")
        self.question = question

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {
            "name": "look", "description": "Look at the picture",
            "parameters": {"type": "object", "properties": {}, "required": []}}}]

    def call_tool(self, state: EpisodeState, name: str, arguments: dict[str, Any]) -> str | ToolOutput:
        meta = state.row.metadata
        return ToolOutput(text="Here is the picture.", images=[render(meta["colour"], meta["shape"], meta["seed"])])

    def reward(self, state: EpisodeState, final_text: str) -> float:
        found = ANSWER.search(final_text or "")
        return float(found is not None and found.group(1).lower() == str(state.row.label).lower())

    def default_dataset(self, n: int, seed: int = 0) -> list[DatasetRow]:
        rng = random.Random(seed)
        rows = []
        for i in range(n):
            colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
            rows.append(DatasetRow(prompt=QUESTIONS[self.question], label=colour if self.question == "colour" else shape,
                                   metadata={"colour": colour, "shape": shape, "seed": seed * 100_000 + i}))
        return rows
