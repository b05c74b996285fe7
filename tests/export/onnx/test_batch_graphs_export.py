"""The batched round's graphs (target_batch, draft_batch): exported beside the single-sequence graphs for a GLANCE
head, recorded in the manifest with its max_batch, and under ONNX Runtime equal, sequence by sequence, to the
single graphs run on each sequence's own past (ragged pasts and trees, slots in no order)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from glance_export.onnx import export_artifacts
from glance_export.onnx.feeds import batch_target_feed, random_tree
from glance_runtime.errors import GlanceError, IntegrityError
from glance_runtime.formats import artifacts as artifacts_format
from glance_runtime.formats.graphs import BATCH_GRAPHS, batch_draft_kv_names, batch_target_kv_names
from glance_runtime.formats.graphs import draft_kv_names, target_kv_names
from support import export_once, tiny_head

SLOTS = [3, 0, 4]  # not contiguous, not in order
PAST = [4, 0, 7]  # ragged, one empty
POOL = (5, 12)  # slots, rows a slot


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    return lambda family, variant="fp32": export_once(snapshot_dir, tmp_path_factory, family, variant)[2]


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feed[i.name] for i in session.get_inputs()})))


def _close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
def test_export_writes_the_batch_graphs_with_max_batch(exported, family):
    out = exported(family)
    manifest = artifacts_format.read(out)
    assert manifest.max_batch == 16 and manifest.batch_graphs
    assert all(name in manifest.graphs and (out / f"{name}.onnx").is_file() for name in BATCH_GRAPHS)
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["limits"]["max_batch"] == 16
    assert {a: manifest.axes[a] for a in ("B", "P", "T_b", "N_b", "S_b", "C_pool")} == {
        "B": (1, 16), "P": (16, 16), "T_b": (1, 32), "N_b": (1, manifest.block_size), "S_b": (0, 255),
        "C_pool": (256, 256)}
    pool = raw["graphs"]["target_batch"]["inputs"]["pool_key_0"]["shape"]
    assert pool == ["P", "C_pool", manifest.target.kv_heads, manifest.target.head_dim]
    assert raw["graphs"]["draft_batch"]["outputs"]["hidden"]["shape"] == ["B", manifest.block_size - 1,
                                                                           manifest.hidden_size]


def test_batched_target_equals_the_target_per_sequence(exported):
    out = exported("qwen2_5_vl")
    manifest = artifacts_format.read(out)
    layers, kvh, hd, hidden = (manifest.target.num_layers, manifest.target.kv_heads, manifest.target.head_dim,
                               manifest.hidden_size)
    rng = np.random.default_rng(7)
    rows, real = 6, [6, 2, 4]  # each sequence's tree, padded to 6 rows whose mask sees only themselves
    pool = {n: rng.normal(size=(*POOL, kvh, hd)).astype(np.float32) for n in batch_target_kv_names(layers)[0]}
    embeds = rng.normal(size=(3, rows, hidden)).astype(np.float32)
    masks, positions = np.zeros((3, rows, rows), bool), np.zeros((3, rows), np.int64)
    for b, size in enumerate(real):
        depths, visible = random_tree(rng, size)
        masks[b] = np.eye(rows, dtype=bool)
        masks[b, :size, :size] = visible
        positions[b, :size] = PAST[b] + depths
    feed = {"inputs_embeds": embeds, "position_ids": np.broadcast_to(positions, (3, 3, rows)).copy(),
            "tree_mask": masks, "slots": np.array(SLOTS), "past_lengths": np.array(PAST),
            "past_rows": np.arange(max(PAST)), **pool}
    batched = _run(_session(out / "target_batch.onnx"), feed)
    single = _session(out / "target.onnx")
    past_names = target_kv_names(layers)[0]
    for b, size in enumerate(real):
        one = {"input_ids": np.zeros((1, size), np.int64), "inputs_embeds": embeds[b, :size],
               "image_embeds": np.zeros((0, hidden), np.float32),
               "position_ids": np.broadcast_to(positions[b, :size], (3, 1, size)).copy(),
               "tree_mask": masks[b, :size, :size]}
        for name, pool_name in zip(past_names, batch_target_kv_names(layers)[0]):
            one[name] = pool[pool_name][SLOTS[b], :PAST[b]]
        ref = _run(single, one)
        for name, value in ref.items():
            _close(batched[name][b, :size], value)


def test_batched_draft_equals_the_draft_per_sequence(exported):
    out = exported("qwen3")
    manifest = artifacts_format.read(out)
    head, width, hidden, block = manifest.head, manifest.tap_width, manifest.hidden_size, manifest.block_size
    rng = np.random.default_rng(8)
    rows, real = 3, [3, 1, 2]  # committed rows a sequence, padded to 3
    pool = {n: rng.normal(size=(*POOL, head.kv_heads, head.head_dim)).astype(np.float32)
            for n in batch_draft_kv_names(head.num_layers)[0]}
    past = np.array(PAST)
    feed = {"context_taps": rng.normal(size=(3, rows, width)).astype(np.float32),
            "context_positions": past[:, None] + np.arange(rows)[None], "context_lengths": np.array(real),
            "block_embeds": rng.normal(size=(3, block, hidden)).astype(np.float32), "start": past + np.array(real),
            "slots": np.array(SLOTS), "past_lengths": past, "past_rows": np.arange(max(PAST)), **pool}
    batched = _run(_session(out / "draft_batch.onnx"), feed)
    single = _session(out / "draft.onnx")
    for b, size in enumerate(real):
        one = {"context_taps": feed["context_taps"][b, :size], "context_positions": feed["context_positions"][b, :size],
               "block_embeds": feed["block_embeds"][b], "start": feed["start"][b:b + 1]}
        for name, pool_name in zip(draft_kv_names(head.num_layers)[0], batch_draft_kv_names(head.num_layers)[0]):
            one[name] = pool[pool_name][SLOTS[b], :PAST[b]]
        ref = _run(single, one)
        _close(batched["hidden"][b], ref["hidden"])
        for name in (n for n in ref if n != "hidden"):
            _close(batched[name][b, :size], ref[name])


def test_a_large_targets_batched_graph_reads_the_targets_data_file(exported):
    out = exported("qwen3", "external")
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["graphs"]["target_batch"]["data_file"] == "target.onnx.data"
    assert not (out / "target_batch.onnx.data").exists()
    assert (out / "target_batch.onnx").stat().st_size < (out / "target.onnx").stat().st_size + (1 << 16)
    stored = {t.name for t in onnx.load(str(out / "target.onnx"), load_external_data=False).graph.initializer}
    model = onnx.load(str(out / "target_batch.onnx"), load_external_data=False)
    weights = [t for t in model.graph.initializer if t.external_data]
    assert weights and {t.name for t in weights} <= stored
    assert artifacts_format.read(out).batch_graphs  # the shared data file is hashed and checked once


def test_fp16_export_has_the_batch_graphs(exported):
    manifest = artifacts_format.read(exported("qwen3", "fp16"))
    inputs = manifest.graphs["target_batch"].inputs
    assert manifest.batch_graphs and inputs["inputs_embeds"]["dtype"] == inputs["pool_key_0"]["dtype"] == "float16"


def test_max_batch_1_exports_no_batch_graphs_and_old_manifests_read_as_1(snapshot_dir, tmp_path):
    snapshot = snapshot_dir("qwen3")
    head = tiny_head(snapshot, tmp_path / "head")
    out = export_artifacts(snapshot, head, tmp_path / "out", max_tree=8, max_context=64, max_batch=1,
                           progress=lambda _: None)
    manifest = artifacts_format.read(out)
    assert manifest.max_batch == 1 and not manifest.batch_graphs
    assert not set(BATCH_GRAPHS) & set(manifest.graphs) and not list(out.glob("*_batch.onnx"))
    raw = json.loads((out / "manifest.json").read_text())
    del raw["limits"]["max_batch"]  # as written before batching
    artifacts_format.write(out, raw)
    assert artifacts_format.read(out).max_batch == 1
    raw["limits"]["max_batch"] = 4  # batch graphs missing for it
    artifacts_format.write(out, raw)
    with pytest.raises(IntegrityError, match="limits.max_batch is 4 but graphs hold no batch graphs"):
        artifacts_format.read(out)
    with pytest.raises(GlanceError, match="max_batch must be at least 1"):
        export_artifacts(snapshot, head, tmp_path / "bad", max_batch=0, progress=lambda _: None)


def test_a_large_quantized_targets_batched_graph_shares_its_quantized_weights(snapshot_dir, tmp_path, monkeypatch):
    from glance_export.onnx import export as export_mod

    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_BYTES", 0)  # every weight in a data file, as a large target's
    snapshot = snapshot_dir("qwen3")
    out = export_artifacts(snapshot, tiny_head(snapshot, tmp_path / "head"), tmp_path / "out", max_tree=8,
                           max_context=64, max_batch=4, quantize="int4", group_size=32, progress=lambda _: None)
    raw = json.loads((out / "manifest.json").read_text())
    record = raw["quantization"]["graphs"]["target_batch"]
    assert raw["graphs"]["target_batch"]["data_file"] == record["data_file"] == "target.onnx.data"
    assert record["tensorrt_data_file"] == "tensorrt/target.onnx.data"
    assert not list(out.rglob("target_batch.onnx.data"))
    manifest = artifacts_format.read(out)
    dims = SimpleNamespace(hidden=manifest.hidden_size, is_vl=False, layers=manifest.target.num_layers,
                           kv_heads=manifest.target.kv_heads, head_dim=manifest.target.head_dim)
    feed = batch_target_feed(dims, np.random.default_rng(3), 3, [2, 0], [1, 4], (4, 64), "float32")
    outputs = _run(_session(out / "target_batch.onnx"), feed)
    assert outputs["hidden"].shape == (2, 3, manifest.hidden_size) and np.isfinite(outputs["hidden"]).all()
