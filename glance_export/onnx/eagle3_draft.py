"""The EAGLE-3 draft step as a graph: one run per tree depth, plus one over the committed rows a round brings.

An EAGLE-3 head drafts autoregressively with a KV cache of its own, so unlike the GLANCE block pass it runs once
per depth, each run over the nodes expanded there. One graph serves both kinds of run: its hidden rows are
`fc` over the target's taps for committed rows (the root run) followed by given hidden rows (a step run: each
node's parent's pre-norm output), so no separate fuse graph is run. The mask is the caller's (built in numpy),
which is what lets one graph do the causal root run and the tree-shaped step runs alike.

The head borrows the target's input embedding: token embeddings come in as rows (the vocab graph embeds a
prompt's ids; later tokens are copied from where an earlier projection left them), and the graph hands back the
embeddings of its own top-k tokens (`topk_embeds`), so the next depth's inputs are device copies, not a vocab run
(a vocab run would also project a dummy row over the whole vocabulary, a full LM head's cost per depth). For that
the graph holds the embedding rows of the tokens it can draft: the draft vocabulary's N rows; where the head
drafts over the whole vocabulary this is a second copy of the table.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from glance_export.model.eagle3 import Eagle3Head
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import EAGLE3_INPUTS, EAGLE3_OUTPUTS, step_kv_names

from .target import head_major, seq_major


def check_exportable(head: Eagle3Head) -> None:
    """Heads with an input embedding of their own (other than the target's, see `borrow_embeddings`) would need
    the ids and their own table in the graph."""
    if head.embed_tokens is not None:
        raise GlanceError("this EAGLE-3 head has an embed_tokens of its own that differs from the target's input "
                          "embedding; only heads whose embedding is the target's can be exported to ONNX so far")


def borrow_embeddings(head: Eagle3Head, target_embedding: torch.Tensor) -> None:
    """Published heads often carry a copy of the target's input embedding (trained frozen, saved beside the head):
    where the head's equals the target's to within half precision's rounding, the graph borrows the target's
    (the head's table is dropped here). A draft only proposes, so a last-bit difference can change which tokens
    are drafted, never the output."""
    own = head.embed_tokens
    if own is None or own.weight.shape != target_embedding.shape:
        return
    if torch.allclose(own.weight.float(), target_embedding.float(), rtol=1e-3, atol=1e-6):
        head.embed_tokens = None


def draft_token_ids(head: Eagle3Head) -> torch.Tensor:
    """Target ids of the head's draft vocabulary, in draft-id order."""
    drafted = head.config.drafted_vocab
    ids = torch.arange(drafted, dtype=torch.int64)
    return ids + head.d2t.to(torch.int64) if head.config.draft_vocab_size is not None else ids


class Eagle3StepGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for an EAGLE-3 draft graph."""

    def __init__(self, head: Eagle3Head, embed_rows: torch.Tensor, branch_k: int):
        super().__init__()
        check_exportable(head)
        self.head, self.branch_k = head, branch_k
        self.register_buffer("token_ids", draft_token_ids(head))
        self.register_buffer("embed_rows", embed_rows.to(head.fc.weight.dtype))
        past, present = step_kv_names(head.config.num_hidden_layers)
        self.input_names = [*EAGLE3_INPUTS, *past]
        self.output_names = [*EAGLE3_OUTPUTS, *present]

    def forward(self, *inputs: torch.Tensor):
        """Inputs in `input_names` order."""
        context_taps, hidden, embeds, position_ids, attention_mask, logit_rows, *past = inputs
        rows = torch.cat([self.head.fuse(context_taps), hidden], dim=0)
        dtype = rows.dtype
        mask = torch.where(attention_mask, torch.zeros((), dtype=dtype),
                           torch.full((), torch.finfo(dtype).min, dtype=dtype))[None, None]
        cache = [(head_major(past[2 * j]), head_major(past[2 * j + 1])) for j in range(len(past) // 2)]
        normed, prenorm, new = self.head(embeds[None], rows[None], position_ids[:, None], cache, mask)
        logits = self.head.logits(normed[0].index_select(0, logit_rows)).float()
        top = torch.topk(logits, self.branch_k, dim=-1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, top.indices)
        out = [self.token_ids[top.indices], logp, self.embed_rows[top.indices], prenorm[0]]
        for k, v in new:
            out += [seq_major(k), seq_major(v)]
        return tuple(out)


def step_feed(dims, rng: np.random.Generator, taps: int, hidden: int, past: int, projected: int, dtype: str,
              tree: bool) -> dict[str, np.ndarray]:
    """A root-like run (`taps` committed rows after `past` cached ones, causal) or a step-like run (`hidden`
    nodes seeing the cached rows and, when `tree`, a random subset of the earlier ones), projecting the last
    `projected` rows."""
    rows = taps + hidden
    mask = np.ones((rows, past + rows), dtype=bool)
    mask[:, past:] = np.tri(rows, dtype=bool)
    if tree:
        mask[:, :past] = rng.random((rows, past)) < 0.7
        mask[:, past:] = np.eye(rows, dtype=bool)
    positions = np.broadcast_to(past + np.arange(rows), (3, rows)).copy()
    if dims.head_mrope:
        positions[1:] += rng.integers(0, 3, size=(2, rows))
    feed = {"context_taps": (rng.normal(size=(taps, dims.n_taps * dims.hidden)) * 4).astype(dtype),
            "hidden": rng.normal(size=(hidden, dims.hidden)).astype(dtype),
            "embeds": rng.normal(size=(rows, dims.hidden)).astype(dtype),
            "position_ids": positions.astype(np.int64), "attention_mask": mask,
            "logit_rows": np.arange(rows - projected, rows, dtype=np.int64)}
    for name in step_kv_names(dims.head_layers)[0]:
        feed[name] = rng.normal(size=(past, dims.head_kv_heads, dims.head_head_dim)).astype(dtype)
    return feed


def trace_feed(dims, rng: np.random.Generator, dtype: str) -> dict[str, np.ndarray]:
    """Sizes distinct from each other and from 1, so no axis is frozen."""
    return step_feed(dims, rng, 3, 2, 4, 2, dtype, tree=False)


def validation_feeds(dims, rng: np.random.Generator, dtype: str) -> list[dict[str, np.ndarray]]:
    """A root run after a prefill (no cache), a root run after a round, and a step run (no taps)."""
    return [step_feed(dims, rng, 7, 0, 0, 1, dtype, tree=False),
            step_feed(dims, rng, 3, 0, 6, 1, dtype, tree=False),
            step_feed(dims, rng, 0, 5, 9, 5, dtype, tree=True)]


def axis_bounds(max_context: int, branch_k: int) -> dict[str, list[int]]:
    """Bounds of the axes only an EAGLE-3 draft graph has (its step rows: a round's nodes at one depth)."""
    step = branch_k
    return {"N_taps": [0, max_context], "M": [0, step], "R_h": [1, max_context], "Q": [1, step],
            "S_h": [0, max_context + (EAGLE3_DEPTH - 1) * step], "C": [1, max_context + EAGLE3_DEPTH * step]}


def dynamic_axes(names: set[str]) -> dict[str, dict[int, str]]:
    axes = {"context_taps": {0: "N_taps"}, "hidden": {0: "M"}, "embeds": {0: "R_h"}, "position_ids": {1: "R_h"},
            "attention_mask": {0: "R_h", 1: "C"}, "logit_rows": {0: "Q"}, "topk_ids": {0: "Q"},
            "topk_logprobs": {0: "Q"}, "topk_embeds": {0: "Q"}, "prenorm": {0: "R_h"}}
    axes.update({n: {0: "S_h"} for n in names if n.startswith("past_")})
    axes.update({n: {0: "R_h"} for n in names if n.startswith("present_")})
    return {k: v for k, v in axes.items() if k in names}


def output_shapes(dims, branch_k: int) -> dict[str, list[int | str]]:
    shapes: dict[str, list[int | str]] = {"topk_ids": ["Q", branch_k], "topk_logprobs": ["Q", branch_k],
                                          "topk_embeds": ["Q", branch_k, dims.hidden], "prenorm": ["R_h", dims.hidden]}
    for j in range(dims.head_layers):
        shapes[f"present_key_{j}"] = shapes[f"present_value_{j}"] = ["R_h", dims.head_kv_heads, dims.head_head_dim]
    return shapes
