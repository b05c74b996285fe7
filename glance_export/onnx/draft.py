"""The draft graph as a torch module: one head pass drafts every sequence's block over [anchor, MASK x (Bk-1)].

Bk is the pass's own: a round that uses a few depths drafts a short block (2..block_size rows), so a shallow tree
does not pay for the head over every row of the block.

The head's own `context_kv` and `forward` do the work; this wrapper reads each sequence's head cache from
the pool (as the target graph reads its past: `target.past_index`, `target.gather_past`) and hides the padding of a ragged batch:
past columns beyond a sequence's `past_lengths` and context rows beyond its `context_lengths`. The block's
embeddings come in and its hidden rows go out: the target's embedding and LM head belong to the vocab graph.
"""
from __future__ import annotations

import torch
from torch import nn

from glance_export.model.head import DraftHead
from glance_runtime.formats.graphs import draft_kv_names

from .target import columns, gather_past, past_index


class DraftGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the draft graph."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head
        cfg = head.config
        pool, new = draft_kv_names(cfg.num_hidden_layers)
        self.input_names = ["context_taps", "context_positions", "context_lengths", "block_embeds", "start",
                            "slots", "past_lengths", "past_rows", *pool]
        self.output_names = ["hidden", *new]

    def forward(self, context_taps, context_positions, context_lengths, block_embeds, start, slots, past_lengths,
                past_rows, *pool):
        new = self.head.context_kv(context_taps, context_positions)
        ctx = []
        index = past_index(pool[0], slots, past_rows)
        for j, (k, v) in enumerate(new):
            ctx.append((torch.cat([gather_past(pool[2 * j], index), k], dim=2),
                        torch.cat([gather_past(pool[2 * j + 1], index), v], dim=2)))
        rows = block_embeds.shape[1]
        dtype = block_embeds.dtype
        new_rows = torch.cumsum(torch.ones_like(context_positions[0]), 0) - 1  # 0..N-1, symbolic in the trace
        offsets = torch.cumsum(torch.ones_like(block_embeds[0, :, 0], dtype=torch.int64), 0) - 1  # 0..Bk-1, too
        # Every block row sees the same columns: one row of them is built, then expanded once over the rows (the
        # opset-23 Attention op takes a mask with the query's rows, not one broadcast along them).
        mask = torch.cat([columns(past_lengths, past_rows, 1, dtype), columns(context_lengths, new_rows, 1, dtype)],
                         dim=-1).expand(-1, -1, rows, -1)
        hidden = self.head(block_embeds, start[:, None] + offsets[None], ctx, mask,
                           torch.zeros_like(mask[..., :1]).repeat(1, 1, 1, rows))
        out = []
        for k, v in new:
            out += [k.transpose(1, 2), v.transpose(1, 2)]  # [B, kvh, N, D] -> [B, N, kvh, D]
        return (hidden[:, 1:], *out)
