"""A chat template is code from the model's files: rendered in jinja2's sandbox, and here also on a budget,
so an edited template that loops for ever or builds gigabytes of text is refused in one line instead of
hanging the command or the server.

The sandbox already stops attribute tricks and ranges over 100,000 items; it does not stop nested loops,
recursion or doubling a string. The budget counts the template's own lines as they run (its compiled code,
traced while it renders: real templates run a few thousand) and caps the size of any text or list the
template builds with `+`, `*` or `**`."""
from __future__ import annotations

import sys
from typing import Any, Callable

from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "<template>"  # the file name jinja2 compiles templates from strings under
MAX_STEPS = 2_000_000  # lines a template may run for one prompt
MAX_SIZE = 1 << 24  # characters (or items) one expression may build


class OverBudget(Exception):
    """The template ran past MAX_STEPS or built something over MAX_SIZE."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `+`, `*` and `**` checked before they run."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 64 and not isinstance(left, float):
            raise OverBudget(f"an exponent of {right}")
        if operator == "*":
            count = right if _size(left) else left if _size(right) else None
            if isinstance(count, int) and max(_size(left), _size(right)) * count > MAX_SIZE:
                raise OverBudget(f"a repetition over {MAX_SIZE} items")
        if operator == "+" and _size(left) + _size(right) > MAX_SIZE:
            raise OverBudget(f"a concatenation over {MAX_SIZE} items")
        return super().call_binop(context, operator, left, right)


def run_on_budget(render: Callable[[], str], steps: int = MAX_STEPS) -> str:
    """`render()` with the template's lines counted; OverBudget past `steps`. Any tracer already set (a
    debugger, coverage) is put back afterwards."""
    left = steps

    def line(frame, event: str, arg: Any):
        nonlocal left
        if event == "line":
            left -= 1
            if left < 0:
                raise OverBudget(f"over {steps} steps")
        return line

    def call(frame, event: str, arg: Any):
        return line if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        return render()
    finally:
        sys.settrace(previous)
