"""What a backend can serve, checked against the decode flags before the first token is decoded.

The loop would otherwise find out mid-answer (a tree wider than the verify graph, a top-k the
draft graph does not return), after some of the answer had already streamed.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError, LimitError
from .loop import DecodeConfig


@dataclass(frozen=True)
class Limits:
    block_size: int  # B of the head (1 without one)
    max_branch_k: int  # the largest top-k a draft pass returns
    max_tree: int | None = None  # largest verify pass, anchor included; None where unbounded
    exported: bool = False  # graphs sized at export time: a re-export lifts the limits


def reachable_nodes(block_size: int, branch_k: int) -> int:
    """Most tree nodes a draft of B-1 offsets with top-k each can give (the budget is capped by it)."""
    return sum(branch_k ** depth for depth in range(1, block_size))


def check_decode(limits: Limits | None, cfg: DecodeConfig) -> None:
    """One-line refusal of flags out of range, or (given the backend's limits) that it cannot serve."""
    if cfg.max_new_tokens < 1 or cfg.budget < 0 or cfg.branch_k < 1:
        raise InputError(f"--max-new-tokens and --branch-k must be >= 1 and --budget >= 0 (got {cfg.max_new_tokens}, "
                          f"{cfg.branch_k} and {cfg.budget}); pass values in those ranges")
    if limits is None or not cfg.speculative or cfg.budget == 0:
        return
    if cfg.branch_k > limits.max_branch_k:
        raise LimitError(f"--branch-k {cfg.branch_k} is above the {limits.max_branch_k} candidates a draft pass "
                          f"returns here; use --branch-k 1..{limits.max_branch_k}"
                          + (f" (or re-export with `glance-export onnx --branch-k {cfg.branch_k}`)"
                             if limits.exported else ""))
    rows = min(cfg.budget, reachable_nodes(limits.block_size, cfg.branch_k)) + 1
    if limits.max_tree is not None and rows > limits.max_tree:
        raise LimitError(f"--budget {cfg.budget} needs a verify pass of {rows} rows but the graphs take at most "
                          f"{limits.max_tree}; use --budget 0..{limits.max_tree - 1} (or re-export with "
                          f"`glance-export onnx --max-tree {rows}`)")
