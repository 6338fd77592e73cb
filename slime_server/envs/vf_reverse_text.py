"""A verifiers environment (single-turn), the example of ``data.source: verifiers`` (examples/verifiers.yaml):
reverse a short text, rewarded by how much of the reversed text the answer gets right in order (the longest
common subsequence's share), so a group's answers differ in reward and a small model has a gradient to climb.

Loaded by verifiers' own rule (``load_environment(**data.env_args)``), like any installed environment; it imports
verifiers, so only a server with the ``verifiers`` extra can load it."""

from __future__ import annotations

import difflib
import random
from typing import Any

import verifiers as vf
from datasets import Dataset

WORDS = ("apple river stone cloud lemon tiger paper music green light table water bread chair smile ocean "
         "plant train happy sugar").split()
SYSTEM = "Reverse the user's text, character by character. Answer with the reversed text only."


def lcs_ratio(completion: Any, answer: str, parser: vf.Parser) -> float:
    """The reward: the longest common subsequence of the answer and the reversed text, as a share of both."""
    said = parser.parse_answer(completion) or ""
    return difflib.SequenceMatcher(None, said.strip(), answer).ratio()


def load_environment(num_rows: int = 256, seed: int = 0, max_words: int = 2) -> vf.Environment:
    if num_rows < 1 or max_words < 1:
        raise ValueError("num_rows and max_words must be >= 1")
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(num_rows)]
    dataset = Dataset.from_list([{"question": t, "answer": t[::-1]} for t in texts])
    parser = vf.Parser()
    return vf.SingleTurnEnv(dataset=dataset, system_prompt=SYSTEM, parser=parser,
                            rubric=vf.Rubric(funcs=[lcs_ratio], weights=[1.0], parser=parser))
