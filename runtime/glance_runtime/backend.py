"""What the decode loop asks of a backend: four calls, all in numpy, with the state kept inside.

The loop owns the algorithm (tree, walk, stop rules, stats); a backend owns the graphs and caches.
That split is what lets the torch reference, ONNX Runtime and TensorRT share one loop, so parity
between them is a property of the backends alone.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Backend(Protocol):
    name: str
    block_size: int  # B: anchor plus B-1 drafted offsets; 1 when no head is loaded

    def prefill(self, prompt) -> tuple[int, float]:
        """Run the prompt; return the first generated token (the first anchor) and the entropy
        (nats) of the distribution it was taken from. The anchor's stream position is the prompt length."""

    def draft(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One head pass for block [anchor, MASK x (B-1)]: top-k ids and log-probs, [B-1, k] each."""

    def verify(self, tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray
               ) -> tuple[np.ndarray, float, np.ndarray]:
        """One target pass over the packed tree [anchor] + nodes at positions start + depth, each row
        seeing the committed prefix and its visible pack rows. Returns the per-row argmax [T], the
        entropy at the anchor row, and the per-row log-prob of the argmax [T] (the target's confidence
        in the token it chose: at the last accepted row, in the next anchor)."""

    def commit(self, rows: np.ndarray) -> None:
        """Keep the KV (and head context) of packed rows `rows` ([0] + accepted path, in order);
        drop the rest. The next anchor then sits at position start + len(rows)."""
