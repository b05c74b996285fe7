"""The draft graph as a torch module: one head pass over [anchor, MASK x (B-1)] with a growing context.

The head's own `context_kv` and `forward` do the work; this wrapper only adapts the cache layout
(sequence-major in and out). The block's embeddings come in and its hidden rows go out: the target's
embedding and LM head belong to the vocab graph.
"""
from __future__ import annotations

import torch
from torch import nn

from glance_export.model.head import DraftHead
from glance_runtime.formats.graphs import draft_kv_names

from .target import head_major, seq_major


class DraftGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the draft graph."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head
        cfg = head.config
        self.register_buffer("offsets", torch.arange(cfg.block_size, dtype=torch.int64), persistent=False)
        past, new = draft_kv_names(cfg.num_hidden_layers)
        self.input_names = ["context_taps", "context_positions", "block_embeds", "start", *past]
        self.output_names = ["hidden", *new]

    def forward(self, *inputs: torch.Tensor):
        """Inputs in `input_names` order."""
        context_taps, context_positions, block_embeds, start, *past = inputs
        new = self.head.context_kv(context_taps[None], context_positions[None])
        ctx = [(torch.cat([head_major(past[2 * j]), k], dim=2), torch.cat([head_major(past[2 * j + 1]), v], dim=2))
               for j, (k, v) in enumerate(new)]
        positions = (start + self.offsets)[None]
        hidden = self.head(block_embeds[None], positions, ctx)
        out = []
        for k, v in new:
            out += [seq_major(k), seq_major(v)]
        return (hidden[0, 1:], *out)
