"""The built-in ``calculator`` environment: the model writes ``<calc>EXPR</calc>`` and gets the value back.

A turn holding ``<calc>EXPR</calc>`` (the last one, if several) is answered with the value of EXPR as text
(integers stay integers; a division that is not exact gives a float rounded to 6 digits; an expression it cannot
evaluate gives ``error``); the episode goes on. A turn without one is the answer: the episode ends with
:func:`distrl.rollout.rewards.integer_match` of that turn's text against the gold answer (the ``arith`` and GSM8K
problems have integer answers; a gold that is not one scores 0). The turn stops at ``</calc>``.

EXPR is parsed with :mod:`ast` and evaluated node by node: numbers, + - * / // % **, unary minus and parentheses
only; exponents above 64 and results above 10**30 in size are refused (``error``). Nothing is ``eval``'d.
"""

from __future__ import annotations

import ast
import operator
import re

from distrl.rollout.envs import Environment

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT, MAX_MAGNITUDE = 64, 10**30


def evaluate(expr: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything else or out of bounds."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expr!r}") from exc
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError("exponent too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise ValueError(str(exc)) from exc
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def format_value(value: int | float) -> str:
    """Integers (and integral floats) as integers, other floats rounded to 6 digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{round(value, 6)}"


class Calculator(Environment):
    """``<calc>EXPR</calc>`` -> the value; a turn without a call is the final answer (see the module docstring)."""

    stop = ("</calc>",)

    def reset(self, problem) -> None:
        self.problem = problem
        return None

    def step(self, model_text: str):
        calls = CALL.findall(model_text)
        if calls:
            try:
                return format_value(evaluate(calls[-1])), 0.0, False, {"calls": 1}
            except ValueError:
                return "error", 0.0, False, {"calls": 1, "errors": 1}
        from distrl.rollout.rewards import integer_match

        try:
            reward, components = integer_match(model_text, self.problem.gold)
        except ValueError:  # a gold that is not an integer
            reward, components = 0.0, {"correct": 0.0}
        return None, reward, True, components
