"""The draft tree of a head that drafts one depth per pass (EAGLE-3), grown as EAGLE-2 grows it (pure numpy).

Depth 1 is the anchor's top-k. At each further depth the `branch_k` best nodes of the depth before (by path score,
the sum of the log-probs along the path) are expanded in one head pass, each into its top-k children. After the
last depth the `budget` best nodes of everything drafted are kept. A child never outscores its parent and ties go
to the node drafted first, so that set is prefix-closed; packed best first it is parents-first, and every prefix of
it is the best tree of that size (which is how `tree.fit` and auto cut it).

Two things differ from expanding blindly, neither changes the tree: a node whose score cannot beat the
`budget`-th best already drafted is not expanded (none of its children could be kept), and growth ends at the
first depth with nothing left worth expanding. A stop token's node is never expanded (nothing verified below it
could be kept); the next best node of its depth is expanded instead.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .backend import StepDrafter
from .tree import Tree

__all__ = ["grow_dynamic"]


def _checked(ids: np.ndarray, logp: np.ndarray, rows: int, k: int) -> tuple[list[list[int]], list[list[float]]]:
    ids, logp = np.asarray(ids), np.asarray(logp)
    if ids.shape != (rows, k) or logp.shape != (rows, k):
        raise ValueError(f"a draft step returned ids {ids.shape} and log-probs {logp.shape}, expected ({rows}, {k})")
    if ids.dtype.kind not in "iu" or np.any(ids < 0):
        raise ValueError("a draft step returned token ids that are not non-negative integers")
    if np.any(np.isnan(logp)) or np.any(logp > 0):
        raise ValueError("a draft step returned log-probs that are not <= 0")
    return ids.astype(np.int64).tolist(), logp.astype(np.float64).tolist()


Deeper = Callable[[list[float], list[int], list[int]], bool]


def grow_dynamic(anchor: int, drafter: StepDrafter, budget: int, branch_k: int, depth: int,
                 leaves: frozenset[int] = frozenset(), deeper: Deeper | None = None) -> Tree:
    """The round's tree: at most `budget` nodes, `depth` deep, `branch_k` expanded per depth (and each into its
    top `branch_k`), from `depth` head passes at most. `deeper(scores, depths, chosen)`, asked before each further
    pass with every node drafted so far and the ones that pass would expand, ends the growth when it returns
    False (`--budget auto`: where the pass cannot pay for itself); the tree is then the best of what was drafted."""
    if budget < 1 or depth < 1 or branch_k < 1:
        return Tree.root(anchor)
    tokens: list[int] = []
    parents: list[int] = []  # index of the parent node, -1 for the anchor
    depths: list[int] = []
    scores: list[float] = []
    rows: dict[int, int] = {}  # node -> its row number in the round's draft steps

    def add(children: list[int], logps: list[float], parent: int, base: float, level: int) -> list[int]:
        first = len(tokens)
        for token, lp in zip(children, logps):
            tokens.append(token)
            parents.append(parent)
            depths.append(level)
            scores.append(base + lp)
        return list(range(first, len(tokens)))

    root_ids, root_logp = drafter.draft_root(int(anchor), branch_k)
    ids, logp = _checked(np.asarray(root_ids)[None], np.asarray(root_logp)[None], rows=1, k=branch_k)
    frontier = add(ids[0], logp[0], -1, 0.0, 1)
    for level in range(2, depth + 1):
        bar = -np.inf
        if len(scores) >= budget:
            bar = -np.partition(-np.asarray(scores), budget - 1)[budget - 1]
        ranked = sorted((n for n in frontier if tokens[n] not in leaves), key=lambda n: (-scores[n], n))
        chosen = [n for n in ranked[:branch_k] if scores[n] > bar]
        if not chosen or (deeper is not None and not deeper(scores, depths, chosen)):
            break
        step_parents = np.array([rows.get(parents[n], -1) for n in chosen], np.int64)
        for n in chosen:
            rows[n] = len(rows)
        ids, logp = _checked(*drafter.draft_step(np.array([tokens[n] for n in chosen], np.int64), step_parents,
                                                 branch_k), rows=len(chosen), k=branch_k)
        frontier = [node for j, n in enumerate(chosen) for node in add(ids[j], logp[j], n, scores[n], level)]
    kept = sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:budget]
    packed = {node: i + 1 for i, node in enumerate(kept)}
    return Tree._trusted([int(anchor)] + [tokens[n] for n in kept],
                         [-1] + [packed.get(parents[n], 0) for n in kept],
                         [0] + [depths[n] for n in kept], [0.0] + [scores[n] for n in kept])
