"""The target's attention as the opset-17 graphs trace it: each query head reads its own KV head in place.

transformers' eager attention repeats every KV head for the query heads that share it (an Expand and a
Reshape of the whole cache, per layer, per pass) and sizes its reshapes from traced shapes, which the
weightless trace cannot fold: about a hundred shape and copy nodes a layer that a runtime executes on
every step. Here the query heads are grouped by the KV head they read (a reshape with the config's
constant head counts), so one MatMul scores a group against its KV head, and the only dimensions left
to the runtime are the batch and the sequence. The arithmetic is eager's: scaled scores, the additive
mask, softmax in fp32, the weighted sum.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface

NAME = "glance_grouped"


def grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key and value [1, KV, S, D], mask [1, 1, T, S] additive -> [1, T, H, D]."""
    kv_heads = module.config.num_key_value_heads
    groups, head_dim = module.num_key_value_groups, module.head_dim
    if query.shape[0] != 1:
        return _batched(query, key, value, attention_mask, scaling, kv_heads, groups), None
    q = query.reshape(kv_heads, groups, -1, head_dim)  # heads h = kv * groups + g, as repeat_kv orders them
    k = key.reshape(kv_heads, 1, -1, head_dim)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # [KV, G, T, S]
    if attention_mask is not None:
        scores = scores + attention_mask  # [1, 1, T, S] broadcasts
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value.reshape(kv_heads, 1, -1, head_dim))  # [KV, G, T, D]
    return out.reshape(1, kv_heads * groups, -1, head_dim).transpose(1, 2), None



def _batched(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
             scaling: float, kv_heads: int, groups: int) -> torch.Tensor:
    """The same for a batch: [B, H, T, D] -> [B, T, H, D], the batch and sequence axes left to the runtime.

    The target graph is traced with B > 1, so this path serves every pass, a lone sequence's included (the one
    above is what torch runs for B = 1: the reference the graph is validated against, and the vision tower). A KV
    head's query heads are stacked along the rows, so each MatMul pairs equal batch axes: a broadcast over the
    groups made the runtime expand the keys."""
    batch, _, rows, head_dim = query.shape
    q = query.reshape(batch, kv_heads, groups * rows, head_dim)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling  # [B, KV, G*T, S]
    if mask is not None:
        scores = (scores.reshape(batch, kv_heads, groups, rows, -1) + mask.unsqueeze(1)).reshape(
            batch, kv_heads, groups * rows, -1)
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # [B, KV, G*T, D]
    return out.reshape(batch, kv_heads * groups, rows, head_dim).transpose(1, 2)


AttentionInterface.register(NAME, grouped_attention)
