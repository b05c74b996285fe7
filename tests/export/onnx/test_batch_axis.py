"""The target and draft graphs' batch axis: one graph per kind serves a lone sequence (a batch of one) and a
batched round. A lone sequence's passes equal the torch model's; a padded batch over ragged pasts in slots in no
order equals, row for row, each of its sequences run alone through the same graph."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from glance_export.model.adapters import Snapshot
from glance_export.model.head import load_head
from glance_export.onnx import export_artifacts
from glance_export.onnx.draft import DraftGraph
from glance_export.onnx.feeds import random_tree
from glance_runtime.errors import GlanceError
from glance_runtime.formats import artifacts as artifacts_format
from glance_runtime.formats.graphs import draft_kv_names, target_kv_names
from support import export_once, tiny_head

SLOTS = [3, 0, 4]  # not contiguous, not in order
PAST = [4, 0, 7]  # ragged, one empty
POOL = (5, 12)  # slots, rows a slot


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    return lambda family, variant="fp32": export_once(snapshot_dir, tmp_path_factory, family, variant)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feed[i.name] for i in session.get_inputs()})))


def _close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
def test_export_records_the_batch_axis(exported, family):
    out = exported(family)[2]
    manifest = artifacts_format.read(out)
    raw = json.loads((out / "manifest.json").read_text())
    assert manifest.max_batch == raw["limits"]["max_batch"] == 16
    assert set(manifest.graphs) <= {"target", "draft", "vocab", "vision"} and not list(out.glob("*_batch*"))
    assert {a: manifest.axes[a] for a in ("B", "P", "C_pool", "T", "S", "N", "S_h")} == {
        "B": (1, 16), "P": (1, 16), "C_pool": (1, 256), "T": (1, 256), "S": (0, 255), "N": (1, 256), "S_h": (0, 255)}
    assert not {"T_b", "N_b", "S_b"} & set(manifest.axes)
    target, draft = raw["graphs"]["target"], raw["graphs"]["draft"]
    assert target["inputs"]["pool_key_0"]["shape"] == ["P", "C_pool", manifest.target.kv_heads,
                                                       manifest.target.head_dim]
    assert target["inputs"]["inputs_embeds"]["shape"] == ["B", "T", manifest.hidden_size]
    assert target["inputs"]["past_rows"]["shape"] == ["S"] and draft["inputs"]["past_rows"]["shape"] == ["S_h"]
    assert draft["inputs"]["block_embeds"]["shape"] == ["B", "Bk", manifest.hidden_size]
    assert draft["outputs"]["hidden"]["shape"] == ["B", "Bd", manifest.hidden_size]
    assert manifest.axes["Bk"] == (2, manifest.block_size) and manifest.short_blocks
    assert draft["outputs"]["ctx_key_0"]["shape"] == ["B", "N", manifest.head.kv_heads, manifest.head.head_dim]


def test_a_lone_sequence_equals_the_torch_model(exported):
    """A prefill into slot 2 of a pool of noise, then a three-row step over it: the hidden rows and new keys are
    the unmodified transformers model's over the whole sequence at once."""
    model_dir, _, out = exported("qwen3")
    manifest = artifacts_format.read(out)
    layers, hidden = manifest.target.num_layers, manifest.hidden_size
    rng = np.random.default_rng(5)
    ids = rng.integers(0, manifest.vocab_size, size=8)
    model = Snapshot(model_dir).load_model()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)[None], output_hidden_states=True, use_cache=True)
        embeds = model.get_input_embeddings()(torch.from_numpy(ids)).numpy()
    pool = {n: rng.normal(size=(3, 16, manifest.target.kv_heads, manifest.target.head_dim)).astype(np.float32)
            for n in target_kv_names(layers)[0]}
    session = _session(out / "target.onnx")
    got = []
    for start, stop in ((0, 5), (5, 8)):
        rows = stop - start
        feed = {"inputs_embeds": embeds[None, start:stop], "position_ids": np.arange(start, stop)[None],
                "tree_mask": np.tri(rows, dtype=bool)[None], "slots": np.array([2]), "past_lengths": np.array([start]),
                "past_rows": np.arange(start), **pool}
        result = _run(session, feed)
        for pool_name, present in zip(target_kv_names(layers)[0], target_kv_names(layers)[1]):
            pool[pool_name][2, start:stop] = result[present][0]
        got.append(result)
    _close(np.concatenate([r["hidden"][0] for r in got]), ref.hidden_states[-1][0].numpy())
    assert got[0]["hidden"].shape == (1, 5, hidden)
    keys = ref.past_key_values.layers[0].keys if hasattr(ref.past_key_values, "layers") else ref.past_key_values[0][0]
    _close(pool["pool_key_0"][2, :8], keys[0].transpose(0, 1).numpy())


def test_a_batch_of_trees_equals_each_sequence_alone(exported):
    out = exported("qwen2_5_vl")[2]
    manifest = artifacts_format.read(out)
    layers, kvh, hd, hidden = (manifest.target.num_layers, manifest.target.kv_heads, manifest.target.head_dim,
                               manifest.hidden_size)
    rng = np.random.default_rng(7)
    rows, real = 6, [6, 2, 4]  # each sequence's tree, padded to 6 rows whose mask sees only themselves
    pool = {n: rng.normal(size=(*POOL, kvh, hd)).astype(np.float32) for n in target_kv_names(layers)[0]}
    embeds = rng.normal(size=(3, rows, hidden)).astype(np.float32)
    masks, positions = np.zeros((3, rows, rows), bool), np.zeros((3, rows), np.int64)
    for b, size in enumerate(real):
        depths, visible = random_tree(rng, size)
        masks[b] = np.eye(rows, dtype=bool)
        masks[b, :size, :size] = visible
        positions[b, :size] = PAST[b] + depths
    no_image = {"input_ids": np.zeros((3, rows), np.int64), "image_embeds": np.zeros((0, hidden), np.float32)}
    feed = {**no_image, "inputs_embeds": embeds, "position_ids": np.broadcast_to(positions, (3, 3, rows)).copy(),
            "tree_mask": masks, "slots": np.array(SLOTS), "past_lengths": np.array(PAST),
            "past_rows": np.arange(max(PAST)), **pool}
    session = _session(out / "target.onnx")
    batched = _run(session, feed)
    for b, size in enumerate(real):
        one = {**no_image, "input_ids": np.zeros((1, size), np.int64), "inputs_embeds": embeds[b:b + 1, :size],
               "position_ids": np.broadcast_to(positions[b, :size], (3, 1, size)).copy(),
               "tree_mask": masks[b:b + 1, :size, :size], "slots": np.array([SLOTS[b]]),
               "past_lengths": np.array([PAST[b]]), "past_rows": np.arange(PAST[b]), **pool}
        for name, value in _run(session, one).items():
            _close(batched[name][b, :size], value[0])


def test_a_batch_of_blocks_equals_each_sequence_alone(exported):
    out = exported("qwen3")[2]
    manifest = artifacts_format.read(out)
    head, width, hidden, block = manifest.head, manifest.tap_width, manifest.hidden_size, manifest.block_size
    rng = np.random.default_rng(8)
    rows, real = 3, [3, 1, 2]  # committed rows a sequence, padded to 3
    pool = {n: rng.normal(size=(*POOL, head.kv_heads, head.head_dim)).astype(np.float32)
            for n in draft_kv_names(head.num_layers)[0]}
    past = np.array(PAST)
    feed = {"context_taps": rng.normal(size=(3, rows, width)).astype(np.float32),
            "context_positions": past[:, None] + np.arange(rows)[None], "context_lengths": np.array(real),
            "block_embeds": rng.normal(size=(3, block, hidden)).astype(np.float32), "start": past + np.array(real),
            "slots": np.array(SLOTS), "past_lengths": past, "past_rows": np.arange(max(PAST)), **pool}
    session = _session(out / "draft.onnx")
    batched = _run(session, feed)
    for b, size in enumerate(real):
        one = {"context_taps": feed["context_taps"][b:b + 1, :size],
               "context_positions": feed["context_positions"][b:b + 1, :size], "context_lengths": np.array([size]),
               "block_embeds": feed["block_embeds"][b:b + 1], "start": feed["start"][b:b + 1],
               "slots": np.array([SLOTS[b]]), "past_lengths": past[b:b + 1], "past_rows": np.arange(PAST[b]), **pool}
        alone = _run(session, one)
        _close(batched["hidden"][b], alone["hidden"][0])
        for name in (n for n in alone if n != "hidden"):
            _close(batched[name][b, :size], alone[name][0])


def test_fp16_export_has_half_precision_pools(exported):
    manifest = artifacts_format.read(exported("qwen3", "fp16")[2])
    inputs = manifest.graphs["target"].inputs
    assert inputs["inputs_embeds"]["dtype"] == inputs["pool_key_0"]["dtype"] == "float16"
    assert manifest.graphs["draft"].inputs["pool_ctx_key_0"]["dtype"] == "float16"


def test_max_batch_bounds_the_batch_axis_and_0_is_refused(snapshot_dir, tmp_path):
    snapshot = snapshot_dir("qwen3")
    head = tiny_head(snapshot, tmp_path / "head")
    out = export_artifacts(snapshot, head, tmp_path / "out", max_tree=8, max_context=64, max_batch=1,
                           progress=lambda _: None)
    manifest = artifacts_format.read(out)
    assert manifest.max_batch == 1 and manifest.axes["B"] == manifest.axes["P"] == (1, 1)
    assert "slots" in manifest.graphs["target"].inputs and not list(out.glob("*_batch*"))
    with pytest.raises(GlanceError, match="max_batch must be at least 1") as err:
        export_artifacts(snapshot, head, tmp_path / "bad", max_batch=0, progress=lambda _: None)
    assert "\n" not in str(err.value)


def test_a_short_block_equals_the_torch_head_over_those_rows(exported):
    """A round that uses a few depths drafts a few rows: the graph runs the head over the rows it is given (their
    positions follow the anchor's), as the torch head does over that short block, not over a whole one."""
    _, head_dir, out = exported("qwen3")
    manifest = artifacts_format.read(out)
    head, width, hidden = manifest.head, manifest.tap_width, manifest.hidden_size
    rng = np.random.default_rng(9)
    pool = {n: rng.normal(size=(*POOL, head.kv_heads, head.head_dim)).astype(np.float32)
            for n in draft_kv_names(head.num_layers)[0]}
    feed = {"context_taps": rng.normal(size=(1, 2, width)).astype(np.float32),
            "context_positions": np.array([[4, 5]]), "context_lengths": np.array([2]),
            "block_embeds": rng.normal(size=(1, 3, hidden)).astype(np.float32), "start": np.array([6]),
            "slots": np.array([3]), "past_lengths": np.array([4]), "past_rows": np.arange(4), **pool}
    got = _run(_session(out / "draft.onnx"), feed)
    graph = DraftGraph(load_head(head_dir)).eval()
    with torch.no_grad():
        ref = graph(*(torch.from_numpy(feed[name]) for name in graph.input_names))
    assert got["hidden"].shape == (1, 2, hidden)
    _close(got["hidden"], ref[0].numpy())
    whole = {**feed, "block_embeds": np.concatenate(
        [feed["block_embeds"], rng.normal(size=(1, manifest.block_size - 3, hidden)).astype(np.float32)], axis=1)}
    assert np.abs(_run(_session(out / "draft.onnx"), whole)["hidden"][0, :2] - got["hidden"][0]).max() > 1e-3
