"""The bench's upper-bound drafts: the target's own greedy continuation seeded into the head's top-k,
with log-probs that say so.

`SeededDrafter` (backends/seeded.py) puts the true token first but keeps the head's own log-probs;
a random head's are nearly flat, so best-first expansion spreads the tree wide instead of deep and
the "upper bound" stops at tau 2-3. Here every seeded offset also gets a confident
distribution (0.9 on the seeded column, the rest shared out), as a good head's would be, so the
tree follows the seeded path and the loop's speed at a high tau shows.
"""
from __future__ import annotations

import math

import numpy as np

from ..backends.seeded import SeededDrafter

CONFIDENCE = 0.9
DEPTH = {"full": lambda block: block - 1, "partial": lambda block: max(1, (block - 1) // 2)}


class ConfidentSeeds(SeededDrafter):
    """Seeds offsets 1..depth (first column) and gives them confident log-probs; deeper offsets stay the head's."""

    def __init__(self, backend, truth: list[int], prompt_len: int, how: str):
        depth = DEPTH[how](backend.block_size)
        super().__init__(backend, truth, prompt_len, lambda d: 0 if d <= depth else None)
        self.depth = depth

    def _confident(self, logp: np.ndarray, rows) -> np.ndarray:
        logp = np.array(logp, dtype=np.float64, copy=True)
        logp[rows, 0] = math.log(CONFIDENCE)
        if logp.shape[-1] > 1:
            logp[rows, 1:] = math.log((1 - CONFIDENCE) / (logp.shape[-1] - 1))
        return logp

    def draft(self, anchor: int, k: int, depth: int | None = None):
        ids, logp = super().draft(anchor, k, depth)
        return ids, self._confident(logp, slice(0, self.depth))

    def draft_root(self, anchor: int, k: int):
        """A step drafter's rounds: the anchor's children and every node on the true path to `depth`."""
        ids, logp = super().draft_root(anchor, k)
        return ids, self._confident(np.asarray(logp)[None], 0)[0]

    def draft_step(self, tokens, parents, k: int):
        ids, logp = super().draft_step(tokens, parents, k)
        rows = [row for row, depth in self.seeded_rows if depth <= self.depth]
        return ids, self._confident(logp, rows) if rows else logp
