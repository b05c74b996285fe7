"""A seeded drafter: wraps a real backend and seeds the target's own greedy continuation into the top-k.

Random heads accept almost nothing, which would leave the walk, multi-token commits and KV
compaction untested, and says nothing about the loop's speed at a given tau. This wrapper knows the
oracle's tokens and, per draft offset, puts the true next token at a chosen top-k column (or removes
it), so full, partial, zero and off-first-branch acceptance all happen on purpose while the target,
tree, verify and commit stay real. Used by the parity tests and the benchmark's upper-bound mode.
"""
from __future__ import annotations

from typing import Callable

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

    def prefill(self, prompt, keep: int = 0):
        return self.inner.prefill(prompt, keep) if keep else self.inner.prefill(prompt)

    def draft(self, anchor: int, k: int, depth: int | None = None):
        ids, logp = self.inner.draft(anchor, k, depth)
        ids = ids.copy()
        generated = self.inner.start - self.prompt_len  # index of the anchor among generated tokens
        for d in range(1, ids.shape[0] + 1):
            true = self.truth[generated + d] if generated + d < len(self.truth) else None
            row = [t for t in ids[d - 1].tolist() if t != true]
            col = self.column(d)
            if true is not None and col is not None:
                row.insert(min(col, k - 1), true)
            else:
                row.append(next(t for t in range(len(row) + k + 1) if t not in row and t != true))
            ids[d - 1] = row[:k]
        return ids, logp

    def verify(self, tokens, depths, visible) -> Verified:
        return self.inner.verify(tokens, depths, visible)

    def commit(self, rows) -> None:
        self.inner.commit(rows)

    def time_graphs(self) -> GraphTimes | None:
        return self.inner.time_graphs()

    def close(self) -> None:
        self.inner.close()
