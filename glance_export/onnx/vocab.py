"""The vocab graph as a torch module: the target's embedding and LM head, in the one graph that owns them.

Both the verify pass and the draft pass need the vocabulary matrices (embeddings in, logits out);
keeping them here instead of in the target and draft graphs means a 151,936-row matrix is stored
once, and a tied embedding stays one tensor (the exporter turns `hidden @ W.T` into a Gemm on W).
Entropy is taken of the first row only (the anchor's, in a verify or prefill projection): the other
rows need none, and on a CPU a full-vocabulary exp per row costs as much as the top-k.
"""
from __future__ import annotations

import torch
from torch import nn


class VocabGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the vocab graph."""

    input_names = ["ids", "hidden"]
    output_names = ["embeds", "topk_ids", "topk_logprobs", "entropy", "topk_embeds"]

    def __init__(self, embed: nn.Embedding, lm_head: nn.Linear, branch_k: int):
        super().__init__()
        self.embed, self.lm_head, self.branch_k = embed, lm_head, branch_k

    def forward(self, *inputs: torch.Tensor):
        """Inputs in `input_names` order (variadic like the other graphs, for the dynamo exporter's shapes)."""
        ids, hidden = inputs
        logits = nn.functional.linear(hidden, self.lm_head.weight).float()
        top = torch.topk(logits, self.branch_k, dim=-1)  # on the logits: column 0 is exactly their argmax
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp[:1].exp() * logp[:1]).sum(-1)
        return self.embed(ids), top.indices, logp.gather(-1, top.indices), entropy, self.embed(top.indices)
