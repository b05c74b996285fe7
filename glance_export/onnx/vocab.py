"""The vocab graph as a torch module: the target's embedding and LM head, in the one graph that owns them.

Both the verify pass and the draft pass need the vocabulary matrices (embeddings in, logits out);
keeping them here instead of in the target and draft graphs means a 151,936-row matrix is stored
once, and a tied embedding stays one tensor (the exporter turns `hidden @ W.T` into a Gemm on W).
Entropy is taken of the first row only (the anchor's, in a verify or prefill projection): the other
rows need none, and on a CPU a full-vocabulary exp per row costs as much as the top-k. The rows' logits
are an output too, for sampling (the runtime fetches them only when it samples; the top-k needs them anyway).
"""
from __future__ import annotations

import torch
from torch import nn


class VocabGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the vocab graph."""

    input_names = ["ids", "hidden"]
    output_names = ["embeds", "topk_ids", "topk_logprobs", "entropy", "topk_embeds", "logits"]

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
        return (self.embed(ids), self.token_ids(top.indices), logp.gather(-1, top.indices), entropy,
                self.embed(top.indices), logits)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return indices


class DraftVocabGraph(VocabGraph):
    """The vocab graph over a head's reduced draft vocabulary: the target's embedding and LM head rows of its
    N draft tokens (one tensor when tied), and the map from a row to its target id, applied in the graph."""

    def __init__(self, embed_rows: torch.Tensor, lm_head_rows: torch.Tensor | None, target_ids: torch.Tensor,
                 branch_k: int):
        embed = nn.Embedding(*embed_rows.shape, _weight=embed_rows, _freeze=True)
        lm_head = nn.Linear(embed_rows.shape[1], embed_rows.shape[0], bias=False, device="meta")
        lm_head.weight = embed.weight if lm_head_rows is None else nn.Parameter(lm_head_rows, requires_grad=False)
        super().__init__(embed, lm_head, branch_k)
        self.register_buffer("target_ids", target_ids.to(torch.int64))

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return self.target_ids[indices]
