"""Every rule a decode setting must meet against a backend, each stated once with its one refusal.

What a backend can serve is checked once its limits are known, before the first token: the loop would
otherwise find out mid-answer (a tree wider than the verify graph, a top-k the draft graph does not
return), after some of the answer had streamed. A flag's own range is checked as it is parsed
(`cli.flags`), and the same settings passed to the API here (`check_settings`), by the same rules.
"""
from __future__ import annotations

import os
import reprlib

from .backend import STEP_DRAFTERS, ServeLimits
from ..defaults import AUTO
from ..errors import InputError, LimitError
from .loop import DecodeConfig


def threads_problem(name: str, value: int) -> str | None:
    """Threads: 1 up to this machine's CPUs (more only oversubscribes them, and thousands exhaust it)."""
    cpus = os.cpu_count() or 1
    if 1 <= value <= cpus:
        return None
    return f"{name} {value} is outside 1..{cpus}, the CPUs of this machine; pass {name} 1..{cpus}"


def whole(name: str, value: object, low: int) -> int:
    """An integer setting passed in Python: an int (not a bool, float or string) of at least `low`."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise InputError(f"{name} must be an integer, got {type(value).__name__} {reprlib.repr(value)}; pass "
                         f"{name}={low} or more")
    value = value.__index__()
    if value < low:
        raise InputError(f"{name} must be >= {low}, got {value}; pass {name} >= {low}")
    return value


def check_settings(*, threads: object = None, budget: object = None, branch_k: object = 1,
                   max_context: object = None, max_tree: object = None) -> None:
    """The API's settings, refused by the rules the command-line flags follow (InputError, one line each)."""
    if threads is not None and (problem := threads_problem("threads", whole("threads", threads, 1))) is not None:
        raise InputError(problem)
    whole("branch_k", branch_k, 1)
    for name, value in (("max_context", max_context), ("max_tree", max_tree)):  # ranged by `runtime_limit`
        if value is not None and (isinstance(value, bool) or not hasattr(type(value), "__index__")):
            raise InputError(f"{name} must be an integer or None, got {type(value).__name__} {reprlib.repr(value)}")
    if budget is not None and budget != AUTO:
        if isinstance(budget, str):
            raise InputError(f"budget {budget!r:.40} is not a budget: pass \"auto\" or an integer >= 0")
        whole("budget", budget, 0)


def check_speculation(budget: object, speculative: bool, remeasure: bool, *, cli: bool = False) -> None:
    """Settings that contradict each other are refused, not dropped: a budget sizes the trees plain decoding
    never builds, and remeasuring measures the costs only auto's budget weighs (`cli`: worded as flags)."""
    budget_, plain, again, auto = (("--budget", "--no-spec", "--remeasure", "--budget auto") if cli else
                                   ("budget=", "speculative=False", "remeasure=True", 'budget="auto"'))
    if not speculative and budget is not None:
        raise InputError(f"{budget_} sizes GLANCE's trees and {plain} decodes without them; drop one")
    if remeasure and not speculative:
        raise InputError(f"{again} measures the costs {auto} weighs and {plain} decodes without trees; drop one")
    if remeasure and budget not in (None, AUTO):
        raise InputError(f"{again} measures the costs {auto} weighs, not a fixed budget; drop {again} or pass {auto}")


def runtime_limit(flag: str, asked: int | None, built: int, source: str, command: str) -> int:
    """A runtime limit (--max-context, --max-tree): the export's or build's bound by default, never above
    it (graphs, profiles and buffers are sized to it)."""
    if asked is None:
        return built
    if not 1 <= asked <= built:
        raise LimitError(f"{flag} {asked} is outside 1..{built}, the range these {source}; "
                          f"{command} with a larger `{flag}`")
    return asked


def check_prompt(rows: int, max_context: int, flag: bool = True) -> None:
    """A prompt of `rows` tokens can never fit `max_context` rows, whatever is committed (`flag`: the bound is
    --max-context's, else the positions the model has)."""
    if rows > max_context and flag:
        raise LimitError(f"prompt longer than --max-context {max_context} ({rows} rows); raise --max-context or "
                         "shorten the prompt")
    if rows > max_context:
        raise LimitError(f"prompt of {rows} tokens is longer than the {max_context} positions of this model; "
                         "shorten the prompt")


def reachable_nodes(block_size: int, branch_k: int, drafter: str = "block") -> int:
    """Most tree nodes a draft of B-1 offsets with top-k each can give (the budget is capped by it). A step drafter
    (EAGLE-3) expands `branch_k` nodes a depth into `branch_k` children each: k at depth 1, k^2 at each further one."""
    if drafter in STEP_DRAFTERS:
        return branch_k + (block_size - 2) * branch_k ** 2 if block_size > 1 else 0
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


def answer_rows(prompt_length: int, max_new_tokens: int) -> int:
    """Context rows an answer of up to `max_new_tokens` can need: the prompt and every answer token but the
    last, which is returned without being written back. A round's tree is cut to the rows left (`tree.fit`),
    down to a plain greedy step, so speculation never needs more than greedy decoding does."""
    return prompt_length + max_new_tokens - 1


def check_context(prompt_length: int, max_new_tokens: int, max_context: int, fix: str) -> None:
    """Refuse, before any work, a prompt whose answer could overflow the context, with speculation or without
    (`fix`: what the caller's user can change)."""
    if prompt_length > max_context:
        raise LimitError(f"prompt longer than --max-context {max_context} ({prompt_length} rows); raise "
                         "--max-context (max_context=) or shorten the prompt")
    needed = answer_rows(prompt_length, max_new_tokens)
    if needed > max_context:
        raise LimitError(f"this needs up to {needed} context rows ({prompt_length} prompt + {max_new_tokens - 1} "
                         f"answer tokens written back) but the model holds {max_context}; {fix}")


def check_decode(limits: ServeLimits, cfg: DecodeConfig) -> None:
    """Refuse a fixed-budget config the backend cannot serve (auto sizes its trees within the limits)."""
    if not cfg.speculative or cfg.budget == 0:
        return
    check_branch_k(limits, cfg.branch_k)
    check_tree(limits, min(cfg.budget, reachable_nodes(limits.block_size, cfg.branch_k, limits.drafter)) + 1,
               cfg.budget)
