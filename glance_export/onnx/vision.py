"""The vision graph as a torch module, for any image size the processor allows.

It reuses the tower's own patch embedding, rotary table, block norms, MLPs and mergers; only the block
attention is written out (plain MatMul/Softmax with an additive window mask), because the HF blocks
split attention by Python-side segment lengths that a traced graph would freeze. Grid-derived index
tensors come in as inputs (see `vision_indices`).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

INDEX_INPUTS = {
    "qwen2_vl": ["vision_pos_ids"],
    "qwen2_5_vl": ["vision_pos_ids", "window_index", "window_ids", "window_reverse"],
    "qwen3_vl": ["vision_pos_ids", "pos_interp_index", "pos_interp_weight"],
}


def block_attention(attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    mask: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional attention of one vision block over [N, C] rows; mask is additive [N, N] or None."""
    n = x.shape[0]
    q, k, v = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, *rope)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * attn.scaling
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(0, 1).reshape(n, -1)
    return attn.proj(out)


class VisionGraph(nn.Module):
    """pixel_values + index inputs -> image_embeds (and deepstack_embeds for Qwen3-VL).

    The grid itself is not an input: everything the tower derives from it arrives as index tensors."""

    def __init__(self, visual: nn.Module, family: str):
        super().__init__()
        self.visual, self.family = visual, family
        self.unit = visual.spatial_merge_size ** 2
        self.full_blocks = set(getattr(visual, "fullatt_block_indexes", range(len(visual.blocks))))
        self.input_names = ["pixel_values", *INDEX_INPUTS[family]]
        self.output_names = ["image_embeds"] + (["deepstack_embeds"] if family == "qwen3_vl" else [])

    def patch_embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The tower's patch convolution written as the matmul it is (its kernel and stride are one whole
        patch, and each row of pixel_values is one flattened patch): the same arithmetic, and unlike a
        convolution it traces on meta tensors."""
        proj = self.visual.patch_embed.proj
        weight = proj.weight.reshape(proj.out_channels, -1)
        x = torch.matmul(pixel_values.to(weight.dtype), weight.t())
        return x if proj.bias is None else x + proj.bias

    def _window_order(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.unit, x.shape[-1]).index_select(0, order)
        return rows.reshape(-1, x.shape[-1])

    def forward(self, *inputs: torch.Tensor):
        """Inputs in `input_names` order."""
        pixel_values, vision_pos_ids, *extra = inputs
        vis = self.visual
        x = self.patch_embed(pixel_values)
        window_mask = None
        if self.family == "qwen3_vl":
            index, weight = extra
            x = x + (vis.pos_embed(index) * weight[:, :, None]).sum(1).to(x.dtype)  # fp32 weights, as HF
        cos, sin = vis.rotary_pos_emb(x, vision_pos_ids)
        if self.family == "qwen2_5_vl":
            order, window_ids, reverse = extra
            x, cos, sin = (self._window_order(t, order) for t in (x, cos, sin))
            same = window_ids[:, None] == window_ids[None, :]
            window_mask = torch.where(same, torch.zeros((), dtype=x.dtype),
                                      torch.full((), torch.finfo(x.dtype).min, dtype=x.dtype))
        deepstack = []
        deep_ids = list(getattr(vis, "deepstack_visual_indexes", []))
        for i, blk in enumerate(vis.blocks):
            mask = None if i in self.full_blocks else window_mask
            x = x + block_attention(blk.attn, blk.norm1(x), (cos, sin), mask)
            x = x + blk.mlp(blk.norm2(x))
            if i in deep_ids:
                deepstack.append(vis.deepstack_merger_list[deep_ids.index(i)](x))
        merged = vis.merger(x)
        if self.family == "qwen2_5_vl":
            merged = merged.index_select(0, reverse)
        if self.family == "qwen3_vl":
            return merged, torch.stack(deepstack)
        return merged
