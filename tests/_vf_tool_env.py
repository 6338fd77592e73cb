"""A multi-turn verifiers environment with a tool, for tests/test_verifiers_source.py: the model is asked to
reverse a word with the ``reverse`` tool, whose argument is one of the known words (an enum: a forced call is a few
tokens); the rubric rewards how close the word it passed is to the asked one (a share, so a group's rewards differ
even for the random tiny model, whose calls the job forces with ``data.sampling_args.tool_choice``). Loaded by
verifiers' own rule: ``environment: tests._vf_tool_env``."""

from __future__ import annotations

import difflib
import json
from typing import Any, Literal

import verifiers as vf
from datasets import Dataset

WORDS = "apple river stone cloud lemon tiger paper music".split()
Word = Literal["apple", "river", "stone", "cloud", "lemon", "tiger", "paper", "music"]


def reverse(text: Word) -> str:
    """Reverse a word, character by character.

    Args:
        text: the word to reverse
    """
    return text[::-1]


def first_call_text(completion: Any) -> str:
    """The ``text`` argument of the first tool call in the completion ('' when there is none)."""
    for msg in completion:
        for call in getattr(msg, "tool_calls", None) or []:
            try:
                return str(json.loads(call.arguments).get("text", ""))
            except (ValueError, AttributeError):
                return ""
    return ""


def passed_the_word(completion: Any, answer: str) -> float:
    return difflib.SequenceMatcher(None, first_call_text(completion), answer).ratio()


def load_environment(num_rows: int = 16, max_turns: int = 2) -> vf.Environment:
    rows = [{"question": f"Reverse the word {w} with the reverse tool.", "answer": w}
            for w in (WORDS * (num_rows // len(WORDS) + 1))[:num_rows]]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[reverse], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[passed_the_word], weights=[1.0]))
