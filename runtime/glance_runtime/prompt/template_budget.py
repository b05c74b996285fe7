"""A chat template is code from the model's files: rendered in jinja2's sandbox, and here also on a budget,
so an edited template that loops for ever or builds gigabytes of text is refused in one line instead of
hanging the command or the server.

The sandbox already stops attribute tricks and ranges over 100,000 items; it does not stop nested loops,
recursion or doubling a string. The budget counts the template's own lines as they run (its compiled code,
traced while it renders: real templates run a few thousand), and caps at MAX_SIZE characters (or items)
what one `+`, `*`, `**`, `%`, `~`, filter or the whole output builds; sizes and widths are checked before
the operation where they are known."""
from __future__ import annotations

import functools
import re
import sys
from typing import Any, Callable, Iterable

from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "<template>"  # the file name jinja2 compiles templates from strings under
MAX_STEPS = 2_000_000  # lines a template may run for one prompt
MAX_SIZE = 1 << 22  # characters (or items) one expression, or the whole rendered prompt, may hold


WIDE = re.compile(r"\d{8,}")  # a width or precision of 10^7 or more in a format string


class OverBudget(Exception):
    """The template ran past MAX_STEPS or built something over MAX_SIZE."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _bounded(value: Any, what: str) -> Any:
    if _size(value) > MAX_SIZE:
        raise OverBudget(f"{what} over {MAX_SIZE} items")
    return value


def _bounded_filter(name: str, run: Callable) -> Callable:
    """A filter whose numeric arguments (widths, counts) and result stay within MAX_SIZE."""
    @functools.wraps(run)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if any(type(a) is int and abs(a) > MAX_SIZE for a in (*args, *kwargs.values())):
            raise OverBudget(f"the {name} filter asked for over {MAX_SIZE}")
        return _bounded(run(*args, **kwargs), f"the {name} filter built")
    return bounded


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `+`, `*`, `**` and `%` checked, and every filter bounded."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.filters = {name: _bounded_filter(name, run) for name, run in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 64 and not isinstance(left, float):
            raise OverBudget(f"an exponent of {right}")
        if operator == "*":
            count = right if _size(left) else left if _size(right) else None
            if isinstance(count, int) and max(_size(left), _size(right)) * count > MAX_SIZE:
                raise OverBudget(f"a repetition over {MAX_SIZE} items")
        if operator == "%" and isinstance(left, str) and WIDE.search(left):
            raise OverBudget("a %-format with a width over 10^7")
        if operator == "+" and _size(left) + _size(right) > MAX_SIZE:
            raise OverBudget(f"a concatenation over {MAX_SIZE} items")
        return _bounded(super().call_binop(context, operator, left, right), f"a {operator!r} that built")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's names
        bound = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in its safe formatter
        owner = getattr(bound, "__self__", None)
        if isinstance(owner, str) and getattr(bound, "__name__", "") in ("format", "format_map") and WIDE.search(owner):
            raise OverBudget("a format with a width over 10^7")
        return _bounded(super().call(__context, __obj, *args, **kwargs), "a call that built")

    def from_string(self, source: Any, *args: Any, **kwargs: Any):
        """The compiled template, its `~` joins bounded (they run as module functions, not operators)."""
        template = super().from_string(source, *args, **kwargs)
        names = template.root_render_func.__globals__
        names["str_join"] = lambda seq: _bounded(str_join(list(_bounded(list(seq), "a join of"))), "a ~ that built")
        names["markup_join"] = lambda seq: _bounded(markup_join(list(seq)), "a ~ that built")
        return template


def render_on_budget(chunks: Callable[[], Iterable[str]], steps: int = MAX_STEPS) -> str:
    """The text of `chunks()` (a template's `generate`) with the template's lines counted and the output
    capped; OverBudget past either. Any tracer already set (a debugger, coverage) is put back afterwards."""
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
        out, size = [], 0
        for chunk in chunks():
            size += len(chunk)
            if size > MAX_SIZE:
                raise OverBudget(f"a prompt over {MAX_SIZE} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        sys.settrace(previous)
