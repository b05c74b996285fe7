"""The draft graph as a torch module: one head pass over [anchor, MASK x (B-1)] with a growing context.

The head's own `context_kv` and `forward` do the work; this wrapper only adapts the cache layout
(sequence-major in and out), builds the block in-graph and reduces the logits to a fixed top-K.
"""
from __future__ import annotations

import torch
from torch import nn

from glance_export.head import DraftHead
from glance_runtime.graphs import draft_kv_names

from .target import head_major, seq_major


class DraftGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.graphs` states for the draft graph."""

    def __init__(self, head: DraftHead, embed: nn.Module, lm_head: nn.Module, branch_k: int):
        super().__init__()
        self.head, self.embed, self.lm_head, self.branch_k = head, embed, lm_head, branch_k
        cfg = head.config
        self.register_buffer("offsets", torch.arange(cfg.block_size, dtype=torch.int64), persistent=False)
        self.register_buffer("masks", torch.full((cfg.block_size - 1,), cfg.mask_token_id, dtype=torch.int64),
                             persistent=False)
        past, new = draft_kv_names(cfg.num_hidden_layers)
        self.input_names = ["context_taps", "context_positions", "anchor", "start", *past]
        self.output_names = ["topk_ids", "topk_logprobs", *new]

    def forward(self, *inputs: torch.Tensor):
        """Inputs in `input_names` order."""
        context_taps, context_positions, anchor, start, *past = inputs
        new = self.head.context_kv(context_taps[None], context_positions[None])
        ctx = [(torch.cat([head_major(past[2 * j]), k], dim=2), torch.cat([head_major(past[2 * j + 1]), v], dim=2))
               for j, (k, v) in enumerate(new)]
        block = torch.cat([anchor, self.masks])[None]
        positions = (start + self.offsets)[None]
        hidden = self.head(self.embed(block), positions, ctx)
        logp = torch.log_softmax(self.lm_head(hidden[0, 1:]).float(), dim=-1)
        top = torch.topk(logp, self.branch_k, dim=-1)
        out = []
        for k, v in new:
            out += [seq_major(k), seq_major(v)]
        return (top.indices, top.values, *out)
