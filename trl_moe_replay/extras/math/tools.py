"""Tools for tool-use GRPO (``GRPOTrainer(tools=[...])``): a calculator, and the call a demonstration makes with it.

TRL builds each tool's JSON schema from its signature and Google-style docstring (``transformers.get_json_schema``:
type hints on every argument, an ``Args:`` section describing each), renders it into the prompt with the chat
template, runs the tool on every call the model writes and feeds back ``str(result)``; an exception becomes
``{"error": message}`` and counts in ``tools/failure_frequency``. So a tool raises on bad input rather than returning
an error text.

Kept apart from :mod:`trl_moe_replay.extras.math.rewards` (what scores a completion) because a tool is what the policy
calls while it generates; the offline recipe's ``--tools calculator`` names :data:`BUILTIN_TOOLS` entries.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any


#: Longest expression the calculator evaluates (characters): bounds its time and the size of its numbers.
MAX_EXPRESSION_CHARS = 200


def _divide(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise ZeroDivisionError("division by zero")
    return a / b  # exact


_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _divide,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Integers with + - * / and parentheses, for example "123+456" or "(12-5)*3".
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string like '123+456', got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"only integers, + - * / and parentheses are allowed, got {ast.unparse(node)!r}")


def calculator_demonstration(row: dict[str, Any]) -> dict[str, Any]:
    """The call a cold-start demonstration makes for a row of the synthetic set with ``expressions=True``:
    ``{"name": "calculator", "arguments": {"expression": row["expression"]}}``."""
    if not row.get("expression"):
        raise ValueError(
            "calculator demonstrations need an 'expression' column (synthetic_math_dataset(..., expressions=True))"
        )
    return {"name": "calculator", "arguments": {"expression": row["expression"]}}


#: Tools known by name to the recipe (``--tools calculator``), with the demonstration the cold start makes for each.
BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}
DEMONSTRATIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"calculator": calculator_demonstration}
