"""The decoding modes one bench compares: AR, the GLANCE tree at each budget, and the same head as a chain."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import GlanceError
from ..loop import DecodeConfig


@dataclass(frozen=True)
class Mode:
    name: str  # "ar", "tree-15", "chain-7"
    kind: str  # "ar", "tree" or "chain"
    budget: int  # tree nodes besides the anchor (0 for AR)
    branch_k: int

    def config(self, max_new_tokens: int) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=max_new_tokens, budget=self.budget, branch_k=self.branch_k,
                            speculative=self.kind != "ar")

    def cap(self, block_size: int) -> int:
        """Most drafted tokens a round can accept: the tree is at most min(budget, B - 1) deep."""
        return min(self.budget, block_size - 1) if self.kind != "ar" else 0


def parse_budgets(text: str) -> list[int]:
    """`7,15,31,63` -> [7, 15, 31, 63] (sorted, unique), or a one-line refusal."""
    try:
        budgets = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        budgets = []
    if not budgets or budgets[0] < 1:
        raise GlanceError(f"--budgets {text!r} must be comma-separated positive integers, e.g. 7,15,31,63")
    return budgets


def modes_for(budgets: list[int], branch_k: int, block_size: int, chain: bool) -> list[Mode]:
    """AR first, then a tree per budget, then (with `chain`) branch-1 chains of min(budget, B - 1) nodes:
    the same head at equal rows verified wherever the budget fits in one block."""
    if block_size < 2:
        raise GlanceError("the backend has no draft head (block size 1); pass --head or artifacts exported with one")
    modes = [Mode("ar", "ar", 0, 1)] + [Mode(f"tree-{b}", "tree", b, branch_k) for b in budgets]
    if chain:
        modes += [Mode(f"chain-{b}", "chain", b, 1) for b in sorted({min(b, block_size - 1) for b in budgets})]
    return modes
