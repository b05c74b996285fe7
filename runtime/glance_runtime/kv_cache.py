"""Preallocated sequence-major KV buffers for graph backends.

Each layer's keys and values live in one `[max_context, kvh, D]` array allocated once. Because rows
are the leading axis, the committed prefix is always the contiguous block `buf[:S]`, so the graphs
read it with no copy, a pass's new rows are written right after it, and committing a verified tree
moves only the accepted rows down over the rejected ones. Memory never grows after construction.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import GlanceError


class KVCache:
    """Keys and values of `layers` layers, interleaved as [key_0, value_0, key_1, ...] like the graphs."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_context: int, dtype=np.float32):
        if max_context < 1:
            raise GlanceError(f"--max-context must be at least 1, got {max_context}")
        self.max_context = int(max_context)
        self.buffers = [np.zeros((self.max_context, kv_heads, head_dim), dtype=dtype) for _ in range(2 * layers)]
        self.length = 0  # committed rows
        self._block_start = 0  # where the last appended block begins (what compact() selects from)

    def view(self, rows: int | None = None) -> list[np.ndarray]:
        """Zero-copy views of the first `rows` (default: all committed) rows of every buffer."""
        rows = self.length if rows is None else rows
        return [buf[:rows] for buf in self.buffers]

    def check_room(self, rows: int) -> None:
        """Fail with the flag to change before a pass that would write past max_context."""
        if self.length + rows <= self.max_context:
            return
        if self.length == 0:
            raise GlanceError(f"prompt longer than --max-context {self.max_context} ({rows} rows); "
                              "raise --max-context or shorten the prompt")
        raise GlanceError(f"context full: {self.length} committed rows + {rows} new exceed --max-context "
                          f"{self.max_context}; raise --max-context or lower --max-new-tokens")

    def append(self, present: Sequence[np.ndarray]) -> None:
        """Write a pass's T new rows (one [T, kvh, D] array per buffer) after the committed rows and commit them."""
        if len(present) != len(self.buffers):
            raise ValueError(f"expected {len(self.buffers)} present tensors, got {len(present)}")
        rows = int(present[0].shape[0])
        self.check_room(rows)
        for buf, new in zip(self.buffers, present):
            buf[self.length:self.length + rows] = new
        self._block_start = self.length
        self.length += rows

    def compact(self, rows: np.ndarray) -> None:
        """Keep rows `rows` (ascending indices into the last appended block), packed right after the rows
        before that block; drop the rest of the block. Rows already in place are not touched."""
        keep = [int(r) for r in rows]  # a handful of rows: plain Python beats numpy's per-call overhead here
        block = self.length - self._block_start
        if keep and (keep[0] < 0 or keep[-1] >= block or any(b <= a for a, b in zip(keep, keep[1:]))):
            raise ValueError(f"compact rows must be ascending indices into the last block, got {keep}")
        first = next((i for i, r in enumerate(keep) if r != i), len(keep))
        if first < len(keep):  # keep[first:] all move: indices are strictly ascending
            dst = slice(self._block_start + first, self._block_start + len(keep))
            src = np.array(keep[first:], dtype=np.int64) + self._block_start
            for buf in self.buffers:
                buf[dst] = buf[src]
        self.length = self._block_start + len(keep)

    def clear(self) -> None:
        """Forget every row (a new prompt); the buffers are reused, not reallocated."""
        self.length = 0
        self._block_start = 0
