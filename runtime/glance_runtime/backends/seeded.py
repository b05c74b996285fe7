"""A seeded drafter: wraps a real backend and seeds the target's own greedy continuation into the top-k.

Random heads accept almost nothing, which would leave the walk, multi-token commits and KV
compaction untested, and says nothing about the loop's speed at a given tau. This wrapper knows the
oracle's tokens and, per draft offset, puts the true next token at a chosen top-k column (or removes
it), so full, partial, zero and off-first-branch acceptance all happen on purpose while the target,
tree, verify and commit stay real. Used by the parity tests and the benchmark's upper-bound mode.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..decode.backend import Backend, BackendInfo, GraphTimes, Verified


class SeededDrafter:
    """`column(offset) -> int | None`: where the true token goes at that offset (None: make it absent).
    Everything but the draft is the wrapped backend's."""

    def __init__(self, backend: Backend, truth: list[int], prompt_len: int, column: Callable[[int], int | None]):
        self.inner, self.truth, self.prompt_len, self.column = backend, truth, prompt_len, column
        self.name, self.block_size = backend.name, backend.block_size
        keep = getattr(backend, "keep_embeddings", None)  # graph backends: embeddings live on the device
        if keep is not None:
            keep(truth)  # a head's drafts arrive with their embeddings; the seeded tokens get theirs once, here

    @property
    def info(self) -> BackendInfo:
        return self.inner.info

    @property
    def start(self) -> int:
        return self.inner.start

    def prefill(self, prompt, **asked):
        return self.inner.prefill(prompt, **asked)

    def _true(self, depth: int) -> int | None:
        """The oracle's token `depth` places after the anchor (None past its end)."""
        at = self.inner.start - self.prompt_len + depth  # the anchor is generated token start - prompt_len
        return self.truth[at] if at < len(self.truth) else None

    def _seed(self, row: list[int], depth: int, k: int) -> list[int]:
        """A top-k row with the true token of `depth` at its column (or absent)."""
        true = self._true(depth)
        row = [t for t in row if t != true]
        col = self.column(depth)
        if true is not None and col is not None:
            row.insert(min(col, k - 1), true)
        else:
            row.append(next(t for t in range(len(row) + k + 1) if t not in row and t != true))
        return row[:k]

    def draft(self, anchor: int, k: int, depth: int | None = None):
        ids, logp = self.inner.draft(anchor, k, depth)
        ids = ids.copy()
        for d in range(1, ids.shape[0] + 1):
            ids[d - 1] = self._seed(ids[d - 1].tolist(), d, k)
        return ids, logp

    def draft_root(self, anchor: int, k: int):
        """A step drafter's first depth, seeded like a block draft's first offset; the round's nodes are followed
        from here, so each node's children are seeded only where its whole path is the oracle's."""
        ids, logp = self.inner.draft_root(anchor, k)
        self._nodes: list[tuple[int, bool]] = []  # per step node: its depth and whether its path is the oracle's
        return np.array(self._seed(np.asarray(ids).tolist(), 1, k), np.int64), logp

    def draft_step(self, tokens, parents, k: int):
        ids, logp = self.inner.draft_step(tokens, parents, k)
        ids = np.array(ids, copy=True)
        self.seeded_rows: list[tuple[int, int]] = []  # (row, the depth of its children) where the truth was seeded
        for i, (token, parent) in enumerate(zip(np.asarray(tokens).tolist(), np.asarray(parents).tolist())):
            depth, on_path = (1, True) if parent < 0 else (self._nodes[parent][0] + 1, self._nodes[parent][1])
            on_path = on_path and token == self._true(depth)
            self._nodes.append((depth, on_path))
            if on_path:
                ids[i] = self._seed(ids[i].tolist(), depth + 1, k)
                self.seeded_rows.append((i, depth + 1))
        return ids, logp

    def verify(self, tokens, depths, visible, **asked) -> Verified:
        return self.inner.verify(tokens, depths, visible, **asked)

    def commit(self, rows) -> None:
        self.inner.commit(rows)

    def time_graphs(self) -> GraphTimes | None:
        return self.inner.time_graphs()

    def close(self) -> None:
        self.inner.close()
