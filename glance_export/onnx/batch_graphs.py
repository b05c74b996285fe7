"""The batched round's graphs as torch modules: one target pass verifies every sequence's tree, one draft
pass drafts every sequence's block.

A batch is padded: B sequences of T rows each (a shorter tree repeats rows its mask hides), each with its own
past. The past is the KV pool itself (every slot's rows of one layer, `[P, C, kvh, D]`), read in place: the
graph gathers the rows of the `slots` it serves up to the longest past (`past_rows`, 0..S-1: a size given as an
input, which TensorRT takes as a shape, where one computed from `past_lengths` would depend on data), and masks
each sequence's columns past its own length. Measured on ONNX Runtime CPU, a padded batch with per-sequence attention is faster than packing
every row under one mask, where each row attends over the union of the contexts (docs/benchmarks.md).
Prefill stays the single-sequence graphs' (with its images), run on the slot's rows in the pool.
"""
from __future__ import annotations

import torch
from torch import nn

from glance_export.model.head import DraftHead
from glance_runtime.formats.graphs import batch_draft_kv_names, batch_target_kv_names

from .target import PassCache, language_model


def gather_past(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pool [P, C, kvh, D] -> head-major [B, kvh, S, D]: rows `rows` ([S]: 0..S-1) of slot `slots[b]`.

    One Gather of D-sized rows, indexed in head-major order, so the layout change costs nothing more: a
    transpose after the gather took most of a batched pass on ONNX Runtime CPU."""
    kv_heads = pool.shape[2]
    heads = torch.arange(kv_heads, dtype=torch.int64, device=slots.device)
    index = (slots[:, None, None] * pool.shape[1] + rows[None, None, :]) * kv_heads + heads[None, :, None]
    picked = pool.reshape(-1, pool.shape[3]).index_select(0, index.reshape(-1))
    return picked.reshape(slots.shape[0], kv_heads, -1, pool.shape[3])


def columns(lengths: torch.Tensor, cols: torch.Tensor, rows: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, rows, len(cols)]: column cols[j] of sequence b is visible iff cols[j] < lengths[b]."""
    seen = (cols[None, :] < lengths[:, None])[:, None, None, :]
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype)
    mask = torch.where(seen, torch.zeros((), dtype=dtype), blocked)
    return mask.expand(-1, -1, rows, -1)


class BatchTargetGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the batched target graph."""

    def __init__(self, model: nn.Module, tap_ids: list[int]):
        super().__init__()
        self.lm = language_model(model)
        self.tap_ids = list(tap_ids)
        self.num_layers = len(self.lm.layers)
        past, present = batch_target_kv_names(self.num_layers)
        self.input_names = ["inputs_embeds", "position_ids", "tree_mask", "slots", "past_lengths", "past_rows", *past]
        self.output_names = ["hidden", *present, "taps"]

    def forward(self, inputs_embeds, position_ids, tree_mask, slots, past_lengths, past_rows, *pool):
        cache = PassCache([(gather_past(pool[2 * l], slots, past_rows),
                            gather_past(pool[2 * l + 1], slots, past_rows)) for l in range(self.num_layers)])
        hidden = inputs_embeds
        blocked = torch.full((), torch.finfo(hidden.dtype).min, dtype=hidden.dtype)
        inner = torch.where(tree_mask, torch.zeros((), dtype=hidden.dtype), blocked)[:, None]
        mask = torch.cat([columns(past_lengths, past_rows, tree_mask.shape[1], hidden.dtype), inner], dim=-1)
        rope = self.lm.rotary_emb(hidden, position_ids)
        taps = {}
        for idx, layer in enumerate(self.lm.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=None, cache=cache, use_cache=True,
                           position_embeddings=rope)
            taps[idx] = hidden
        hidden = self.lm.norm(hidden)
        taps[self.num_layers - 1] = hidden
        present = []
        for l in range(self.num_layers):
            k, v = cache.present[l]
            present += [k.transpose(1, 2), v.transpose(1, 2)]  # [B, kvh, T, D] -> [B, T, kvh, D]
        return (hidden, *present, torch.cat([taps[i] for i in self.tap_ids], dim=-1))


class BatchDraftGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the batched draft graph."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head
        cfg = head.config
        self.register_buffer("offsets", torch.arange(cfg.block_size, dtype=torch.int64), persistent=False)
        past, new = batch_draft_kv_names(cfg.num_hidden_layers)
        self.input_names = ["context_taps", "context_positions", "context_lengths", "block_embeds", "start",
                            "slots", "past_lengths", "past_rows", *past]
        self.output_names = ["hidden", *new]

    def forward(self, context_taps, context_positions, context_lengths, block_embeds, start, slots, past_lengths,
                past_rows, *pool):
        new = self.head.context_kv(context_taps, context_positions)
        ctx = []
        for j, (k, v) in enumerate(new):
            ctx.append((torch.cat([gather_past(pool[2 * j], slots, past_rows), k], dim=2),
                        torch.cat([gather_past(pool[2 * j + 1], slots, past_rows), v], dim=2)))
        rows = block_embeds.shape[1]
        dtype = block_embeds.dtype
        new_rows = torch.cumsum(torch.ones_like(context_positions[0]), 0) - 1  # 0..N-1, symbolic in the trace
        mask = torch.cat([columns(past_lengths, past_rows, rows, dtype),
                          columns(context_lengths, new_rows, rows, dtype)], dim=-1)
        hidden = self.head(block_embeds, start[:, None] + self.offsets[None], ctx, mask,
                           block_embeds.new_zeros(()).expand(block_embeds.shape[0], 1, rows, rows))
        out = []
        for k, v in new:
            out += [k.transpose(1, 2), v.transpose(1, 2)]
        return (hidden[:, 1:], *out)
