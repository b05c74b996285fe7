"""The target graph as a torch module: one pass for prefill, plain decode and tree verify.

It drives the model's own rotary embedding, decoder layers and final norm, so the exported graph
computes what the reference backend computes; the embedding and LM head are the vocab graph's. Only
the cache and the mask are ours: the past K/V arrive as sequence-major tensors, a pass-through cache
hands them to each layer and keeps this pass's rows, and the 4D additive mask is built in-graph from
the pass's boolean tree mask.
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


class TargetGraph(nn.Module):
    """Inputs and outputs exactly as `glance_runtime.formats.graphs` states for the target graph."""

    def __init__(self, model: nn.Module, tap_ids: list[int], image_token_id: int | None, deepstack: int = 0):
        super().__init__()
        self.lm = language_model(model)
        self.tap_ids = list(tap_ids)
        self.image_token_id = image_token_id
        self.deepstack = deepstack
        self.num_layers = len(self.lm.layers)
        past, present = target_kv_names(self.num_layers)
        images = ["input_ids", "inputs_embeds", "image_embeds"] if image_token_id is not None else ["inputs_embeds"]
        images += ["deepstack_embeds"] if deepstack else []
        self.input_names = [*images, "position_ids", "tree_mask", *past]
        self.output_names = ["hidden", *present, "taps"]

    def embed(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor, image_embeds: torch.Tensor | None):
        """Token embeddings with image-token rows replaced by the vision rows, in order.

        Rows are replaced only when the pass holds exactly as many image tokens as image rows (a
        prefill with its image), as the HF model does; other passes gather the zero pad row and
        discard it, so a decode pass may pass zero rows or a dummy row."""
        embeds = inputs_embeds[None]
        if image_embeds is None:
            return embeds, None, None
        is_img = input_ids[0] == self.image_token_id
        count = is_img.to(torch.int64).sum()
        rows = torch.ones_like(image_embeds[:, 0], dtype=torch.int64).sum()  # stays symbolic when traced
        use = is_img & (count == rows)
        index = torch.where(use, torch.cumsum(is_img.to(torch.int64), 0) - 1, rows)
        picked = padded(image_embeds).index_select(0, index).to(embeds.dtype)
        embeds = torch.where(use[None, :, None], picked[None], embeds)
        return embeds, use, index

    def additive_mask(self, tree_mask: torch.Tensor, past_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, T, S+T]: every row sees the past; inside the pass, what tree_mask allows."""
        past = torch.zeros_like(tree_mask[:, :1], dtype=dtype).expand(-1, past_rows.shape[0])
        blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype)
        inner = torch.where(tree_mask, torch.zeros((), dtype=dtype), blocked)
        return torch.cat([past, inner], dim=1)[None, None]

    def forward(self, *inputs: torch.Tensor):
        named = dict(zip(self.input_names, inputs))
        input_ids, position_ids, tree_mask = named.get("input_ids"), named["position_ids"], named["tree_mask"]
        image_embeds, deepstack_embeds = named.get("image_embeds"), named.get("deepstack_embeds")
        past = inputs[-2 * self.num_layers:]
        cache = PassCache([(head_major(past[2 * l]), head_major(past[2 * l + 1])) for l in range(self.num_layers)])
        hidden, use, index = self.embed(input_ids, named["inputs_embeds"], image_embeds)
        mask = self.additive_mask(tree_mask, past[0], hidden.dtype)
        rope = self.lm.rotary_emb(hidden, position_ids)
        taps = {}
        for idx, layer in enumerate(self.lm.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=None, cache=cache, use_cache=True,
                           position_embeddings=rope)
            taps[idx] = hidden
            if deepstack_embeds is not None and idx < self.deepstack:
                add = padded(deepstack_embeds[idx]).index_select(0, index).to(hidden.dtype)
                hidden = hidden + torch.where(use[None, :, None], add[None], torch.zeros_like(add[None]))
        hidden = self.lm.norm(hidden)
        taps[self.num_layers - 1] = hidden  # transformers reports the last layer after the final norm
        present = []
        for l in range(self.num_layers):
            k, v = cache.present[l]
            present += [seq_major(k), seq_major(v)]
        tap_out = torch.cat([taps[i] for i in self.tap_ids], dim=-1)[0]
        return (hidden[0], *present, tap_out)
