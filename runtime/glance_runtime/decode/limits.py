"""Every rule a decode setting must meet, each stated once with its one refusal.

Flag values are checked as they are parsed (argparse types: every command declaring a flag refuses a
bad value in the same words, before anything is opened). What a backend can serve is checked once its
limits are known, before the first token: the loop would otherwise find out mid-answer (a tree wider
than the verify graph, a top-k the draft graph does not return), after some of the answer had streamed.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable

from .backend import ServeLimits
from ..defaults import AUTO
from ..errors import InputError, LimitError
from .loop import DecodeConfig


def _integer(flag: str, text: str) -> int:
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a whole number; pass an integer {flag}")
    return int(value)


def at_least(flag: str, minimum: int) -> Callable[[str], int]:
    """An integer flag with a lower bound (--max-new-tokens, --branch-k, --samples, ...)."""
    def parse(text: str) -> int:
        value = _integer(flag, text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum} (got {value}); pass {flag} {minimum} "
                                             "or more")
        return value
    return parse


def between(flag: str, low: int, high: int, why: str) -> Callable[[str], int]:
    """An integer flag with both bounds, `why` saying where the upper one comes from (sizes that would
    otherwise run until stopped or exhaust the machine: --layers, --n, --steps, ...)."""
    def parse(text: str) -> int:
        value = _integer(flag, text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} {value} is outside {low}..{high} ({why}); pass {flag} "
                                             f"{low}..{high}")
        return value
    return parse


def positive(flag: str) -> Callable[[str], float]:
    """A finite number above 0 (memory budgets in GiB, seconds)."""
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a positive number; pass a finite {flag} > 0")
        return value
    return parse


def integer(flag: str) -> Callable[[str], int]:
    """An integer flag whose range is a backend's (--max-context, --max-tree: `runtime_limit`)."""
    return lambda text: _integer(flag, text)


def _cpus() -> int:
    return os.cpu_count() or 1


def _threads_rule(name: str, value: int) -> str | None:
    """Threads: 1 up to this machine's CPUs (more only oversubscribes them, and thousands exhaust it)."""
    cpus = _cpus()
    if 1 <= value <= cpus:
        return None
    return f"{name} {value} is outside 1..{cpus}, the CPUs of this machine; pass {name} 1..{cpus}"


def threads(text: str) -> int:
    """`--threads`: as `_threads_rule`."""
    value = _integer("--threads", text)
    if (problem := _threads_rule("--threads", value)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def whole(name: str, value: object, low: int, high: int | None = None, optional: bool = False) -> int | None:
    """An integer setting passed in Python: a real int (not a bool, float or string) within its bounds."""
    if value is None and optional:
        return None
    if type(value) is not int and not (hasattr(value, "__index__") and not isinstance(value, bool)):
        raise InputError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}; pass {name}={low} "
                         "or more" + (", or None" if optional else ""))
    value = int(value.__index__())
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise InputError(f"{name} must be {bound}, got {value}; pass {name} {bound}")
    return value


def check_settings(*, threads: object = None, budget: object = None, branch_k: object = 1,
                   max_context: object = None, max_tree: object = None) -> None:
    """The API's settings, refused by the rules the command-line flags follow (InputError, one line each)."""
    value = whole("threads", threads, 1, optional=True)
    if value is not None and (problem := _threads_rule("threads", value)) is not None:
        raise InputError(problem)
    whole("branch_k", branch_k, 1)
    for name, value in (("max_context", max_context), ("max_tree", max_tree)):  # ranged by `runtime_limit`
        if value is not None and (isinstance(value, bool) or not hasattr(type(value), "__index__")):
            raise InputError(f"{name} must be an integer or None, got {type(value).__name__} {value!r:.40}")
    if budget is not None and budget != AUTO:
        if isinstance(budget, str):
            raise InputError(f"budget {budget!r:.40} is not a budget: pass \"auto\" or an integer >= 0")
        whole("budget", budget, 0)


def budget(text: str) -> int | str:
    """`--budget`: auto, or tree nodes besides the anchor (0: plain greedy steps)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = _integer("--budget", text)
    except argparse.ArgumentTypeError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a budget: pass auto or an integer --budget >= 0")
    return value


def runtime_limit(flag: str, asked: int | None, built: int, source: str, command: str) -> int:
    """A runtime limit (--max-context, --max-tree): the export's or build's bound by default, never above
    it (graphs, profiles and buffers are sized to it)."""
    if asked is None:
        return built
    if not 1 <= asked <= built:
        raise LimitError(f"{flag} {asked} is outside 1..{built}, the range these {source}; "
                          f"{command} with a larger `{flag}`")
    return asked


def reachable_nodes(block_size: int, branch_k: int) -> int:
    """Most tree nodes a draft of B-1 offsets with top-k each can give (the budget is capped by it)."""
    return sum(branch_k ** depth for depth in range(1, block_size))


def check_branch_k(limits: ServeLimits, branch_k: int) -> None:
    """A draft pass returns at most `max_branch_k` candidates per offset."""
    if branch_k > limits.max_branch_k:
        raise LimitError(f"--branch-k {branch_k} is above the {limits.max_branch_k} candidates a draft pass "
                          f"returns here; use --branch-k 1..{limits.max_branch_k}"
                          + (f" (or re-export with `glance-export onnx --branch-k {branch_k}`)"
                             if limits.exported else ""))


def check_tree(limits: ServeLimits, rows: int, budget: int | None = None) -> None:
    """A verify pass holds at most `max_tree` rows, anchor included (`budget`: the flag that asked for them)."""
    if limits.max_tree is not None and rows > limits.max_tree:
        asked = f"--budget {budget} needs" if budget is not None else "this tree needs"
        raise LimitError(f"{asked} a verify pass of {rows} rows, above --max-tree {limits.max_tree}; use --budget "
                          f"0..{limits.max_tree - 1}" + (f" (or re-export with `glance-export onnx --max-tree {rows}`)"
                                                          if limits.exported else ""))


def check_decode(limits: ServeLimits, cfg: DecodeConfig) -> None:
    """Refuse a fixed-budget config the backend cannot serve (auto sizes its trees within the limits)."""
    if not cfg.speculative or cfg.budget == 0:
        return
    check_branch_k(limits, cfg.branch_k)
    check_tree(limits, min(cfg.budget, reachable_nodes(limits.block_size, cfg.branch_k)) + 1, cfg.budget)
