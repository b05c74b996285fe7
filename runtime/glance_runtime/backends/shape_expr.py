"""Tensor dims written as expressions of a graph's axes ("S + T", "floor(N_patch/4)"), evaluated for one pass.

A graph cut into parts passes values between them whose dims are sums and products of the graph's own axes
(a KV concat is S + T rows); the part files declare them so, as symbolic shape inference writes them. The
builder evaluates them at each profile's min/opt/max, the ONNX Runtime chain at each pass's input shapes.
Only integer arithmetic on axis names is accepted, parsed with `ast` (never `eval`).
"""
from __future__ import annotations

import ast
import math
from fractions import Fraction
from typing import Mapping

from ..errors import GlanceError

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: Fraction(a) / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_CALLS = {"floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min}


def _parse(dim: str) -> ast.expr:
    try:
        return ast.parse(dim, mode="eval").body
    except SyntaxError:
        raise GlanceError(f"tensor dim {dim!r} is not an expression of the graph's axes; re-export the graph") from None


def symbols(dim: int | str) -> set[str]:
    """The axis names a dim reads (none for a fixed size)."""
    if isinstance(dim, int):
        return set()
    return {node.id for node in ast.walk(_parse(dim)) if isinstance(node, ast.Name) and node.id not in _CALLS}


def evaluate(dim: int | str, axes: Mapping[str, int]) -> int:
    """The size a dim takes where each axis has the value `axes` gives it."""
    if isinstance(dim, int):
        return dim

    def value(node: ast.expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in axes:
                raise GlanceError(f"tensor dim {dim!r} reads axis {node.id!r}, which no input binds; re-export the "
                                  f"graph")
            return axes[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS \
                and not node.keywords:
            return _CALLS[node.func.id](*(value(arg) for arg in node.args))
        raise GlanceError(f"tensor dim {dim!r} is not integer arithmetic on the graph's axes; re-export the graph")

    result = value(_parse(dim))
    if Fraction(result).denominator != 1:
        raise GlanceError(f"tensor dim {dim!r} is {result} at {dict(axes)}, not a whole size; re-export the graph")
    return int(result)


def bind(declared: list[int | str], shape: tuple[int, ...], axes: dict[str, int]) -> None:
    """Learn the axes a declared shape names plainly (a dim that is one axis name) from an actual shape."""
    for dim, size in zip(declared, shape):
        if isinstance(dim, str) and dim.isidentifier():
            axes.setdefault(dim, int(size))
