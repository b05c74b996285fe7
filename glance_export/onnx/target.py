"""The target graph as a torch module: one pass for prefill, plain decode and tree verify, alone or batched.

It drives the model's own rotary embedding, decoder layers and final norm, so the exported graph
computes what the reference backend computes; the embedding and LM head are the vocab graph's. Only
the cache and the mask are ours. The past is the KV pool itself (every slot's rows of one layer,
`[P, C, kvh, D]`), read in place: the graph gathers the rows of the `slots` it serves up to the longest
past (`past_rows`, 0..S-1: a size given as an input, which TensorRT takes as a shape, where one computed
from `past_lengths` would depend on data) and masks each sequence's columns past its own length. A
pass-through cache hands the gathered rows to each layer and keeps this pass's rows. A lone sequence is
a batch of one; measured on ONNX Runtime CPU, a padded batch with per-sequence attention is faster than
packing every row under one mask, where each row attends over the union of the contexts.
"""
from __future__ import annotations

import torch
from torch import nn

from glance_runtime.formats.graphs import target_kv_names


class PassCache:
    """Stands in for a transformers Cache: concatenates the given past with this pass's rows."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]]):
        self.past = past
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.present[layer_idx] = (keys, values)
        past_k, past_v = self.past[layer_idx]
        return torch.cat([past_k, keys], dim=2), torch.cat([past_v, values], dim=2)


def language_model(model: nn.Module) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a VL or text-only model."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def seq_major(x: torch.Tensor) -> torch.Tensor:
    """[1, kvh, rows, D] -> [rows, kvh, D]."""
    return x[0].transpose(0, 1)


def head_major(x: torch.Tensor) -> torch.Tensor:
    """[rows, kvh, D] -> [1, kvh, rows, D]."""
    return x.transpose(0, 1).unsqueeze(0)


def padded(rows: torch.Tensor) -> torch.Tensor:
    """rows [N, H] plus one zero row at index N, so gathers stay in range even when N is 0."""
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])], dim=0)


def past_index(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, kvh, S]: where in a pool [P, C, kvh, D] seen as rows of D the past of each sequence lies, head-major
    (rows `rows` ([S]: 0..S-1) of slot `slots[b]`). Every layer's pool has one shape, so a graph works this out
    once and every layer gathers with it (`gather_past`)."""
    kv_heads = pool.shape[2]
    heads = torch.arange(kv_heads, dtype=torch.int64, device=slots.device)
    return (slots[:, None, None] * pool.shape[1] + rows[None, None, :]) * kv_heads + heads[None, :, None]


def gather_past(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool [P, C, kvh, D] -> head-major [B, kvh, S, D] at `past_index`'s rows.

    One Gather of D-sized rows, indexed in head-major order, so the layout change costs nothing more (a
    transpose after the gather took most of a batched pass on ONNX Runtime CPU). The index carries the
    output's shape, so no Reshape is sized from S, which is 0 for a prefill (an ONNX Reshape reads a 0 as
    "keep this axis")."""
    return nn.functional.embedding(index, pool.reshape(-1, pool.shape[3]))


def columns(lengths: torch.Tensor, cols: torch.Tensor, rows: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, rows, len(cols)]: column cols[j] of sequence b is visible iff cols[j] < lengths[b]."""
    seen = (cols[None, :] < lengths[:, None])[:, None, None, :]
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype)
    mask = torch.where(seen, torch.zeros((), dtype=dtype), blocked)
    return mask if isinstance(rows, int) and rows == 1 else mask.expand(-1, -1, rows, -1)


class TargetGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the target graph."""

    def __init__(self, model: nn.Module, tap_ids: list[int], image_token_id: int | None, deepstack: int = 0):
        super().__init__()
        self.lm = language_model(model)
        self.tap_ids = list(tap_ids)
        self.image_token_id = image_token_id
        self.deepstack = deepstack
        self.num_layers = len(self.lm.layers)
        pool, present = target_kv_names(self.num_layers)
        images = ["input_ids", "inputs_embeds", "image_embeds"] if image_token_id is not None else ["inputs_embeds"]
        images += ["deepstack_embeds"] if deepstack else []
        self.input_names = [*images, "position_ids", "tree_mask", "slots", "past_lengths", "past_rows", *pool]
        self.output_names = ["hidden", *present, "taps"]

    def embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor, image_embeds: torch.Tensor | None):
        """Token embeddings with image-token rows replaced by the vision rows, in order over the batch's
        flattened rows.

        Rows are replaced only when the pass holds exactly as many image tokens as image rows (a
        prefill with its image), as the HF model does; other passes gather the zero pad row and
        discard it, so a decode pass may pass zero rows or a dummy row."""
        if image_embeds is None:
            return inputs_embeds, None, None
        is_img = input_ids.reshape(-1) == self.image_token_id
        count = is_img.to(torch.int64).sum()
        rows = torch.ones_like(image_embeds[:, 0], dtype=torch.int64).sum()  # stays symbolic when traced
        use = is_img & (count == rows)
        index = torch.where(use, torch.cumsum(is_img.to(torch.int64), 0) - 1, rows)
        picked = padded(image_embeds).index_select(0, index).to(inputs_embeds.dtype).reshape(inputs_embeds.shape)
        use = use.reshape(input_ids.shape)[..., None]
        return torch.where(use, picked, inputs_embeds), use, index

    def forward(self, *inputs: torch.Tensor):
        named = dict(zip(self.input_names, inputs))
        position_ids, tree_mask = named["position_ids"], named["tree_mask"]
        slots, past_lengths, past_rows = named["slots"], named["past_lengths"], named["past_rows"]
        deepstack_embeds = named.get("deepstack_embeds")
        pool = inputs[-2 * self.num_layers:]
        index = past_index(pool[0], slots, past_rows)
        cache = PassCache([(gather_past(pool[2 * l], index), gather_past(pool[2 * l + 1], index))
                           for l in range(self.num_layers)])
        hidden, use, index = self.embed(named.get("input_ids"), named["inputs_embeds"], named.get("image_embeds"))
        blocked = torch.full((), torch.finfo(hidden.dtype).min, dtype=hidden.dtype)
        inner = torch.where(tree_mask, torch.zeros((), dtype=hidden.dtype), blocked)[:, None]
        mask = torch.cat([columns(past_lengths, past_rows, tree_mask.shape[1], hidden.dtype), inner], dim=-1)
        rope = self.lm.rotary_emb(hidden, position_ids)
        taps = {}
        for idx, layer in enumerate(self.lm.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=None, cache=cache, use_cache=True,
                           position_embeddings=rope)
            taps[idx] = hidden
            if deepstack_embeds is not None and idx < self.deepstack:
                add = padded(deepstack_embeds[idx]).index_select(0, index).to(hidden.dtype).reshape(hidden.shape)
                hidden = hidden + torch.where(use, add, torch.zeros_like(add))
        hidden = self.lm.norm(hidden)
        taps[self.num_layers - 1] = hidden  # transformers reports the last layer after the final norm
        present = []
        for l in range(self.num_layers):
            k, v = cache.present[l]
            present += [k.transpose(1, 2), v.transpose(1, 2)]  # [B, kvh, T, D] -> [B, T, kvh, D]
        return (hidden, *present, torch.cat([taps[i] for i in self.tap_ids], dim=-1))
