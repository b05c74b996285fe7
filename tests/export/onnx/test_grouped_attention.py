"""The exported graphs' attention computes what transformers' eager attention computes, without repeating KV heads."""
from __future__ import annotations

import types

import onnx
import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

from glance_export.onnx.grouped_attention import grouped_attention
from support import ALL_FAMILIES, export_once


def _module(heads: int, kv_heads: int, head_dim: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(config=types.SimpleNamespace(num_key_value_heads=kv_heads),
                                 num_key_value_groups=heads // kv_heads, head_dim=head_dim, training=False)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (16, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("rows,past", [(1, 0), (1, 9), (5, 7)])
@pytest.mark.parametrize("batch", [1, 3])  # a lone sequence's path and the batched one the graphs are traced on
def test_matches_eager_attention(heads, kv_heads, rows, past, batch):
    g = torch.Generator().manual_seed(heads * 100 + rows * 10 + past)
    module, dim = _module(heads, kv_heads, 8), 8
    query = torch.randn(batch, heads, rows, dim, generator=g)
    key = torch.randn(batch, kv_heads, past + rows, dim, generator=g)
    value = torch.randn(batch, kv_heads, past + rows, dim, generator=g)
    tree = torch.rand(batch, rows, rows, generator=g) < 0.5
    tree |= torch.eye(rows, dtype=torch.bool)
    seen = torch.cat([torch.rand(batch, rows, past, generator=g) < 0.7, tree], 2)  # ragged pasts hide columns
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[:, None]
    ours, _ = grouped_attention(module, query, key, value, mask, scaling=dim ** -0.5)
    theirs, _ = eager_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    assert ours.shape == theirs.shape == (batch, rows, heads, dim)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_exported_target_repeats_no_kv_heads(snapshot_dir, tmp_path_factory, family):
    """Per layer, the traced target expands no cache and reads only the batch's and the sequence's sizes at run
    time (once for transformers' own reshapes, once for the grouped scores)."""
    _, _, art = export_once(snapshot_dir, tmp_path_factory, family)
    graph = onnx.load(str(art / "target.onnx"), load_external_data=False).graph
    layers: dict[str, list[str]] = {}
    for node in graph.node:
        if node.name.startswith("/layers."):
            layers.setdefault(node.name.split("/")[1], []).append(node.op_type)
    assert layers
    for ops in layers.values():
        assert "Expand" not in ops
        assert ops.count("Shape") <= 4
