"""The decoding modes one bench compares: AR, the GLANCE tree at each budget, the same head as a chain,
and `--budget auto` (each round's tree sized by the runner's AutoBudget policy)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decode.auto_budget import AutoBudget
from ..defaults import AUTO
from ..errors import GlanceError
from ..decode.loop import DecodeConfig


@dataclass(frozen=True)
class Mode:
    name: str  # "ar", "tree-15", "chain-7", "auto"
    kind: str  # "ar", "tree", "chain" or "auto"
    budget: int  # tree nodes besides the anchor (0 for AR; auto's largest tree)
    branch_k: int
    policy: AutoBudget | None = field(default=None, compare=False)  # auto's per-round choices

    def config(self, max_new_tokens: int) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=max_new_tokens, budget=self.budget, branch_k=self.branch_k,
                            speculative=self.kind != "ar", auto=self.policy)

    def cap(self, block_size: int) -> int:
        """Most drafted tokens a round can accept: the tree is at most min(budget, B - 1) deep."""
        return min(self.budget, block_size - 1) if self.kind != "ar" else 0


def parse_budgets(text: str) -> tuple[list[int], bool]:
    """`63,7,15,auto` -> ([7, 15, 63], True): the fixed budgets (sorted, unique) and whether auto runs too,
    or a one-line refusal. At least one fixed budget: the law and the calibration curve are fitted on them."""
    parts = [part.strip().lower() for part in text.split(",") if part.strip()]
    try:
        budgets = sorted({int(part) for part in parts if part != AUTO})
    except ValueError:
        budgets = []
    if not budgets or budgets[0] < 1:
        raise GlanceError(f"--budgets {text!r} must be comma-separated positive integers (at least one) and "
                          "auto if wanted, e.g. 7,15,31,63,auto")
    return budgets, AUTO in parts


def modes_for(budgets: list[int], branch_k: int, block_size: int, chain: bool) -> list[Mode]:
    """AR first, then a tree per budget, then (with `chain`) branch-1 chains of min(budget, B - 1) nodes:
    the same head at equal rows verified wherever the budget fits in one block."""
    if block_size < 2:
        raise GlanceError("the backend has no draft head (block size 1); pass --head or artifacts exported with one")
    modes = [Mode("ar", "ar", 0, 1)] + [Mode(f"tree-{b}", "tree", b, branch_k) for b in budgets]
    if chain:
        modes += [Mode(f"chain-{b}", "chain", b, 1) for b in sorted({min(b, block_size - 1) for b in budgets})]
    return modes


def auto_mode(policy: AutoBudget, branch_k: int) -> Mode:
    """auto verifies at most the policy's largest tree; its cap is min(that, B - 1) like a fixed tree's."""
    return Mode(AUTO, AUTO, policy.max_nodes, branch_k, policy)
