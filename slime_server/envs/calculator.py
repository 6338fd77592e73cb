"""``calculator``: arithmetic word problems solved by calling a calculator tool.

The tool evaluates +, -, *, /, ** and parentheses on numbers through Python's ``ast`` (never
``eval``), with limits on exponent size and expression length, so a model cannot hang the server.
Reward: 1 when the final answer's last number equals the label (numeric match), else 0.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import warnings
from typing import Any

from slime_server.envs.base import DatasetRow, Environment, EpisodeState
from slime_server.envs.rewards import numeric_match

_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
                         ast.UAdd: operator.pos, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv}
MAX_EXPRESSION = 200
MAX_EXPONENT = 64
# Python warns on stderr of some expressions it still parses (``3in 4``: "invalid decimal literal"), which the tool
# refuses anyway (not arithmetic): a model's expression must not print into the server's output (README's first job
# printed that line in a CI run). Parsed under a file name of their own, those warnings alone are ignored.
_SOURCE = "<calculator>"
warnings.filterwarnings("ignore", category=SyntaxWarning, module=_SOURCE)


class CalculatorError(ValueError):
    pass


def evaluate(expression: str) -> float:
    """Evaluate an arithmetic expression safely; CalculatorError on anything else."""
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), _SOURCE, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
            try:
                return _OPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
        raise CalculatorError(f"unsupported element {type(node).__name__}")

    value = ev(tree)
    if isinstance(value, complex) or not math.isfinite(value):
        raise CalculatorError("the result is not a finite real number")
    return value


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


TEMPLATES = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "{a} + {b}"),
    ("{name} had {a} coins and spent {b}. How many coins are left?", "{a} - {b}"),
    ("A box holds {a} pencils. How many pencils are in {b} boxes?", "{a} * {b}"),
    ("{a} cookies are shared equally among {b} children. How many does each child get?", "{a} / {b}"),
]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana"]


class CalculatorEnv(Environment):
    name = "calculator"
    system_prompt = ("Solve the problem. Use the calculator tool for arithmetic, then state the final "
                     "answer as a number.")
    max_turns = 3

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {
            "name": "calculator", "description": "Evaluate an arithmetic expression such as (3 + 4) * 2.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}}]

    def call_tool(self, state: EpisodeState, name: str, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "error: 'expression' must be a string"
        try:
            return format_number(evaluate(expression))
        except CalculatorError as e:
            return f"error: {e}"

    def reward(self, state: EpisodeState, final_text: str) -> float:
        return numeric_match(final_text, state.row.label)

    def default_dataset(self, n: int, seed: int = 0) -> list[DatasetRow]:
        rng = random.Random(seed)
        rows = []
        for _ in range(n):
            text, expr = rng.choice(TEMPLATES)
            b = rng.randint(2, 9)
            a = b * rng.randint(2, 12) if "/" in expr else rng.randint(10, 99)
            values = {"a": a, "b": b, "name": rng.choice(NAMES)}
            expression = expr.format(**values)
            rows.append(DatasetRow(prompt=text.format(**values), label=format_number(evaluate(expression)),
                                   metadata={"expression": expression}))
        return rows
