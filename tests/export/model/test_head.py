"""The draft head: tap layout, checkpoint round trip in the published format, and its attention contract."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from glance_export.model.adapters import Snapshot
from glance_export.model.head import (HeadConfig, check_head_matches, head_config_for, init_head, load_head,
                                pick_mask_token, save_head, tap_layers)
from glance_runtime.errors import GlanceError

PUBLISHED_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}.weight" for i in range(2) for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")}


def test_tap_layers_follow_the_published_rule():
    assert tap_layers(36, 1) == [18]
    assert tap_layers(36, 5) == [1, 9, 17, 25, 33]
    assert tap_layers(28, 3) == [1, 13, 25]


@pytest.fixture(scope="module")
def snap(snapshot_dir):
    return Snapshot(snapshot_dir("qwen2_5_vl"))


def test_checkpoint_round_trip_uses_published_layout(snap, tmp_path):
    cfg = head_config_for(snap, 2, 8, pick_mask_token(snap))
    head = init_head(cfg, seed=3)
    out = save_head(head, tmp_path / "head")
    assert set(load_file(str(out / "model.safetensors"))) == PUBLISHED_KEYS
    raw = json.loads((out / "config.json").read_text())
    assert raw["block_size"] == 8 and raw["num_target_layers"] == 4
    assert raw["dflash_config"] == {"target_layer_ids": [1, 1], "mask_token_id": cfg.mask_token_id}
    loaded = load_head(out)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob(".head.*")), "no temporary directory may be left behind"


def test_seed_makes_init_reproducible(snap):
    cfg = head_config_for(snap, 1, 4, 0)
    a, b, c = init_head(cfg, 1), init_head(cfg, 1), init_head(cfg, 2)
    assert torch.equal(a.fc.weight, b.fc.weight) and not torch.equal(a.fc.weight, c.fc.weight)


def test_mask_token_is_first_row_past_the_tokenizer(snap):
    assert pick_mask_token(snap) == len(snap.tokenizer)


def _head(snap, layers=1, block=8):
    head = init_head(head_config_for(snap, layers, block, 0), seed=0)
    with torch.no_grad():  # wide weights so that a wrong mask or position visibly changes outputs
        for p in head.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.5)
    return head


def test_block_attention_is_non_causal_and_sees_context(snap):
    head = _head(snap)
    taps = torch.randn(1, 10, 64)
    ctx = head.context_kv(taps, torch.arange(10)[None])
    block = torch.randn(1, 8, 64)
    pos = torch.arange(10, 18)[None]
    base = head(block, pos, ctx)
    changed = block.clone()
    changed[0, 7] += 1.0
    assert not torch.allclose(head(changed, pos, ctx)[0, 0], base[0, 0]), "row 0 must see the last block row"
    other_ctx = head.context_kv(taps + 1.0, torch.arange(10)[None])
    assert not torch.allclose(head(block, pos, other_ctx), base)


def test_context_cache_grows_by_appending(snap):
    """Context K/V depend only on their own row, which is what lets the runtime cache them."""
    head = _head(snap)
    taps = torch.randn(1, 12, 64)
    whole = head.context_kv(taps, torch.arange(12)[None])
    first = head.context_kv(taps[:, :7], torch.arange(7)[None])
    rest = head.context_kv(taps[:, 7:], torch.arange(7, 12)[None])
    for (k, v), (k1, v1), (k2, v2) in zip(whole, first, rest):
        torch.testing.assert_close(k, torch.cat([k1, k2], 2))
        torch.testing.assert_close(v, torch.cat([v1, v2], 2))


def test_context_mask_hides_rows_like_dropping_them(snap):
    head = _head(snap)
    taps = torch.randn(1, 9, 64)
    ctx = head.context_kv(taps, torch.arange(9)[None])
    block, pos = torch.randn(1, 8, 64), torch.arange(9, 17)[None]
    mask = torch.zeros(1, 1, 8, 9)
    mask[..., 5:] = torch.finfo(torch.float32).min
    dropped = [(k[:, :, :5], v[:, :, :5]) for k, v in ctx]
    torch.testing.assert_close(head(block, pos, ctx, mask), head(block, pos, dropped), atol=1e-5, rtol=1e-5)


def test_head_for_another_target_is_refused(snap, snapshot_dir):
    other = Snapshot(snapshot_dir("qwen3"))
    cfg = head_config_for(snap, 1, 8, 0)
    cfg.num_target_layers = 7
    with pytest.raises(GlanceError, match="use a head trained for this target"):
        check_head_matches(init_head(cfg, 0), other)


def test_bad_head_directory_is_a_clear_error(tmp_path):
    with pytest.raises(GlanceError, match="not a head directory"):
        load_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(GlanceError, match="lacks 'dflash_config'"):
        load_head(tmp_path)


def test_config_json_round_trip():
    cfg = HeadConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=300, block_size=16, num_target_layers=8,
                     target_layer_ids=[1, 5], mask_token_id=299, rope_theta=1e6)
    assert HeadConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
