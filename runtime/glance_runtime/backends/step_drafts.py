"""EAGLE-3 drafting on a graph backend: `draft_root` and `draft_step` over the exported step graph.

The head keeps a KV cache of its own (the backend's `head_kv`): committed rows first, then the rows of the round's
drafted nodes, which are dropped when the next round starts. A committed head row i reads the target's taps of row
i (through `fc`, in the graph) and the embedding of token i + 1, so the head runs a committed row only once the
token after it is known: the root run of a round covers the rows from the first not yet cached up to the anchor's
predecessor, whose top-k is depth 1. A drafted node's row reads its own token and its parent's pre-norm output.

The backend keeps the taps of every committed row (its `pending` buffer, never consumed on this path), so a
prompt that keeps `keep` rows of the last one recomputes head row keep - 1, whose next token may have changed.
Embeddings never need a vocab run after the prompt: committed tokens were projected by the last verify, and the
step graph returns the embeddings of its own top-k.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..decode.limits import check_branch_k
from ..defaults import EAGLE3_DEPTH
from ..errors import GlanceError
from ..formats.graphs import step_kv_names


def head_rows(max_context: int, branch_k: int) -> int:
    """Rows the head's cache needs: every committed row plus a round's drafted nodes (one depth expands at most
    branch_k nodes, depth 1 is the root run's)."""
    return max_context + (EAGLE3_DEPTH - 1) * branch_k


class StepDrafts:
    """The step-drafter state of one GraphBackend whose manifest's head_kind is eagle3."""

    def __init__(self, backend: Any):
        """`backend`: the GraphBackend it drafts for (typed loosely: graph_backend imports this module)."""
        self.backend = backend
        m = backend.manifest
        self.k, self.mrope = m.branch_k, m.head_mrope
        hidden, k = m.hidden_size, m.branch_k
        self.round_rows = (EAGLE3_DEPTH - 1) * k
        new = backend._new
        context = backend.max_context
        self.root_embeds = new((context, hidden), backend.float)
        self.root_prenorm = new((context, hidden), backend.float)
        self.step_embeds = new((k, hidden), backend.float)
        self.step_hidden = new((k, hidden), backend.float)
        self.node_prenorm = new((self.round_rows, hidden), backend.float)
        self.cands = new(((1 + self.round_rows) * k, hidden), backend.float)  # root's top-k, then each node's
        self.top_ids = new((k, k), np.int64)
        self.top_logp = new((k, k), np.float32)
        self.positions = new((3 * context,), np.int64)
        self.step_mask = new((k * (head_rows(context, k) + k),), np.bool_)
        self.logit_rows = new((k,), np.int64)
        self.past_names, self.present_names = step_kv_names(m.head.num_layers)
        self.tokens = np.zeros(context + 1, np.int64)  # committed stream ids
        self.stream_pos = np.zeros((3, context + 1), np.int64)  # the head's positions of committed rows
        self.cached = 0  # committed rows in the head's cache
        self._new_round()

    def _new_round(self) -> None:
        self.depths: list[int] = []
        self.seen = np.zeros((self.round_rows, self.round_rows), bool)  # node j's ancestors and itself
        self.root_row = -1

    # -- what the backend tells it ------------------------------------------------------------------

    def prompt(self, ids: np.ndarray, positions: np.ndarray, keep: int, delta: int) -> None:
        """A prefill of rows keep.. of `ids` at the target's `positions` ([3, 1, T] or [1, T]) for those rows."""
        length = len(ids)
        self.tokens[keep:length] = ids[keep:]
        if self.mrope and positions.ndim == 3:
            self.stream_pos[:, keep:length] = positions[:, 0, :]
        else:
            self.stream_pos[:, keep:length] = np.arange(keep, length) + (delta if self.mrope else 0)
        self.cached = min(self.cached, keep - 1) if keep else 0
        self._new_round()

    def committed(self, start: int, tokens: np.ndarray, delta: int) -> None:
        """Tokens committed at stream rows start.. (the anchor first)."""
        rows = np.arange(start, start + len(tokens))
        self.tokens[rows] = tokens
        self.stream_pos[:, rows] = rows + (delta if self.mrope else 0)

    # -- the step drafter -----------------------------------------------------------------------------

    def _run(self, taps, hidden, embeds, rows: int, positions: np.ndarray, mask, mask_array: np.ndarray,
             projected: np.ndarray, cands_first: int, prenorm) -> tuple[np.ndarray, np.ndarray]:
        b, kv = self.backend, self.backend.head_kv
        device = b.device
        device.upload(self.positions.tensor((3, rows)), np.ascontiguousarray(positions))
        device.upload(mask, mask_array)
        q = len(projected)
        device.upload(self.logit_rows.rows(q), projected)
        inputs = {"context_taps": taps, "hidden": hidden, "embeds": embeds, "position_ids": self.positions.tensor((3, rows)),
                  "attention_mask": mask, "logit_rows": self.logit_rows.rows(q),
                  **dict(zip(self.past_names, kv.past()))}
        outputs = {"topk_ids": self.top_ids.rows(q), "topk_logprobs": self.top_logp.rows(q),
                   "topk_embeds": self.cands.tensor((q, self.k, self.cands.shape[1]),
                                                   cands_first * self.cands.row_bytes),
                   "prenorm": prenorm, **dict(zip(self.present_names, kv.new_rows(rows)))}
        b.graphs["draft"].run(inputs, outputs)
        kv.appended(rows)
        ids, logp = device.download(self.top_ids.rows(q)), device.download(self.top_logp.rows(q))
        b.known.update({int(t): (self.cands, cands_first + i) for i, t in enumerate(ids.reshape(-1))})
        return ids, logp

    def draft_root(self, anchor: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        b = self.backend
        check_branch_k(b.info.limits, k)
        start = b.start
        first = max(min(self.cached, start - 1), 0)
        b.head_kv.truncate(first)  # the last round's nodes (and any row whose next token changed) go
        rows = start - first
        tokens = np.append(self.tokens[first + 1:start], np.int64(anchor))
        b.embed_rows(tokens, self.root_embeds, 0)
        anchor_at = (self.root_embeds, rows - 1)
        mask = np.ones((rows, first + rows), bool)
        mask[:, first:] = np.tri(rows, dtype=bool)
        b.known = {}
        self._new_round()
        ids, logp = self._run(b.pending.rows(rows, first), self.step_hidden.rows(0), self.root_embeds.rows(rows), rows,
                              self.stream_pos[:, first:start], b.mask.tensor(mask.shape), mask,
                              np.array([rows - 1], np.int64), 0, self.root_prenorm.rows(rows))
        b.known[int(anchor)] = anchor_at
        self.cached, self.root_row = start, rows - 1
        return ids[0, :k].astype(np.int64), logp[0, :k].astype(np.float64)

    def draft_step(self, tokens: np.ndarray, parents: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        b = self.backend
        check_branch_k(b.info.limits, k)
        tokens, parents = np.asarray(tokens, np.int64), np.asarray(parents, np.int64)
        n, first = len(tokens), len(self.depths)
        if self.root_row < 0:
            raise GlanceError("draft_step before draft_root: a round starts with the root")
        if not 0 < n <= self.k or first + n > self.round_rows or len(parents) != n or np.any(parents >= first):
            raise GlanceError(f"a draft step takes 1..{self.k} nodes below earlier ones, at most {self.round_rows} a "
                              f"round; got {n} after {first}")
        b.embed_rows(tokens, self.step_embeds, 0)
        start = b.start
        depths = np.empty(n, np.int64)
        mask = np.zeros((n, start + first + n), bool)
        mask[:, :start] = True
        for j, parent in enumerate(parents.tolist()):
            if parent < 0:
                src, depths[j] = self.root_prenorm.rows(1, self.root_row), 1
            else:
                src, depths[j] = self.node_prenorm.rows(1, parent), self.depths[parent] + 1
                self.seen[first + j] = self.seen[parent]
            self.seen[first + j, first + j] = True
            mask[j, start:] = self.seen[first + j, :first + n]
            b.device.copy(self.step_hidden.rows(1, j), src)
        self.depths += depths.tolist()
        positions = np.broadcast_to(start - 1 + depths + (b.delta if self.mrope else 0), (3, n))
        ids, logp = self._run(b.pending.rows(0), self.step_hidden.rows(n), self.step_embeds.rows(n), n,
                              positions, self.step_mask.tensor(mask.shape), mask,
                              np.arange(n, dtype=np.int64), (1 + first) * self.k, self.node_prenorm.rows(n, first))
        return ids[:, :k].astype(np.int64), logp[:, :k].astype(np.float64)
