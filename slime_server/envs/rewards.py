"""Reward functions shared by environments: exact, numeric and math-answer matching, format checks."""

from __future__ import annotations

import math
import re
from fractions import Fraction

_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/\d+|[eE][-+]?\d+)?")  # 12, 1,234.5, 3/4, 1e-3
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def normalize_text(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().lower()).strip(" .")


def exact_match(prediction: str, label: str) -> float:
    return float(normalize_text(prediction) == normalize_text(str(label)))


def parse_number(s: str) -> float | None:
    s = s.strip().replace(",", "")
    try:
        return float(Fraction(s)) if "/" in s else float(s)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def numeric_match(prediction: str | float | None, label: float | str, *, rel_tol: float = 1e-6,
                  abs_tol: float = 1e-6) -> float:
    value = last_number(prediction) if isinstance(prediction, str) else prediction
    target = parse_number(str(label)) if not isinstance(label, int | float) else float(label)
    if value is None or target is None:
        return 0.0
    return float(math.isclose(value, target, rel_tol=rel_tol, abs_tol=abs_tol))


def extract_answer(text: str) -> str:
    """The final answer of a solution: ``\\boxed{...}``, else ``<answer>...</answer>``, else the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    tagged = _ANSWER_TAG.findall(text)
    return tagged[-1] if tagged else text


def math_answer_match(text: str, label: float | str) -> float:
    """Math checking: the extracted answer equals the label as a number, else as normalised text."""
    answer = extract_answer(text)
    target = parse_number(str(label))
    if target is not None:
        return numeric_match(answer, target)
    return exact_match(answer, str(label))


def has_answer_format(text: str) -> float:
    """1 if the answer is given in ``<answer>...</answer>`` or ``\\boxed{}``."""
    return float(bool(_BOXED.search(text) or _ANSWER_TAG.search(text)))
