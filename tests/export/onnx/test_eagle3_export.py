"""`glance-export onnx` with an EAGLE-3 head: the manifest says what the runtime needs, the draft step graph
computes what the torch head does on the same inputs (a head rotating with M-RoPE's three axes and drafting over a
reduced vocabulary included), and fp16, int8 and int4 exports decode as their own greedy decode does."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from glance_export.cli import main as export_main
from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import eagle3_config_for, init_eagle3, log_softmax_top, rows_mask, save_eagle3
from glance_export.onnx import export_artifacts
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime.formats.artifacts import read as read_manifest
from glance_runtime.prompt.codec import exported_codec
from support import SEEDS

DRAFTED = 80  # a reduced draft vocabulary: every fourth target id


def _head(snapshot: Path, out: Path, mrope: bool = False, drafted: int | None = None, own_embeddings: bool = False):
    snap = Snapshot(snapshot)
    cfg = eagle3_config_for(snap, draft_vocab_size=drafted)
    if mrope:  # the target's own M-RoPE layout (contiguous sections, or Qwen3-VL's interleaved columns)
        target = snap.text_config["rope_parameters"]
        cfg = replace(cfg, rope={**cfg.rope, **{k: v for k, v in target.items() if k.startswith("mrope_")}})
    ids = torch.arange(drafted) * 4 if drafted else None
    head = init_eagle3(cfg, seed=2, draft_ids=ids, own_embeddings=own_embeddings, std=0.3)
    save_eagle3(head, out)
    return head


@pytest.fixture(scope="module")
def mrope_export(snapshot_dir, tmp_path_factory):
    """qwen2_5_vl with an M-RoPE head over a reduced draft vocabulary, exported through the command line."""
    root = tmp_path_factory.mktemp("eagle3_mrope")
    snapshot = snapshot_dir("qwen2_5_vl")
    head = _head(snapshot, root / "head", mrope=True, drafted=DRAFTED)
    code = export_main(["onnx", "--model", str(snapshot), "--head", str(root / "head"), "--out", str(root / "out"),
                        "--max-tree", "32", "--max-context", "256"])
    assert code == 0
    return snapshot, head, root / "out"


def test_manifest_records_the_step_drafter(mrope_export):
    _, head, out = mrope_export
    m = read_manifest(out)
    raw = json.loads((out / "manifest.json").read_text())
    assert m.head_kind == "eagle3" and m.head_mrope and m.block_size == EAGLE3_DEPTH + 1
    assert m.draft_vocab_size is None and "draft_vocab" not in m.graphs  # the step graph maps its own ids
    assert m.max_batch == 1 and m.axes["B"] == (1, 1) and not list(out.glob("*_batch.onnx"))  # one sequence a pass
    draft = raw["graphs"]["draft"]
    assert draft["kind"] == "eagle3" and draft["max_depth"] == EAGLE3_DEPTH and draft["draft_vocab_size"] == DRAFTED
    assert draft["tap_layer_ids"] == raw["graphs"]["target"]["tap_layer_ids"] == head.config.taps(4)
    assert (m.head.num_layers, m.head.kv_heads, m.head.head_dim) == (1, head.config.num_key_value_heads,
                                                                     head.config.head_dim)
    assert m.tap_width == 3 * m.hidden_size


def test_step_graph_equals_the_torch_head(mrope_export):
    """Committed rows through fc after a cache, then tree-shaped node rows with their own hidden inputs and three
    distinct position axes: ids equal, log-probs within 1e-4, d2t applied."""
    _, head, out = mrope_export
    session = ort.InferenceSession(str(out / "draft.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    cfg = head.config
    hidden, past, taps, nodes = cfg.hidden_size, 6, 3, 4
    rows = taps + nodes
    feed = {"context_taps": rng.normal(size=(taps, 3 * hidden)).astype(np.float32) * 4,
            "hidden": rng.normal(size=(nodes, hidden)).astype(np.float32),
            "embeds": rng.normal(size=(rows, hidden)).astype(np.float32),
            "position_ids": (past + np.arange(rows) + rng.integers(0, 4, size=(3, rows))).astype(np.int64),
            "attention_mask": np.concatenate([rng.random((rows, past)) < 0.8,
                                              np.tri(rows, dtype=bool) & (rng.random((rows, rows)) < 0.6)
                                              | np.eye(rows, dtype=bool)], axis=1),
            "logit_rows": np.array([0, 3, 4, 5, 6], np.int64)}
    kv = rng.normal(size=(2, past, cfg.num_key_value_heads, cfg.head_dim)).astype(np.float32)
    feed["past_key_0"], feed["past_value_0"] = kv[0], kv[1]
    ids, logp, _, prenorm, key, _ = session.run(None, feed)
    t = {name: torch.from_numpy(value) for name, value in feed.items()}
    with torch.no_grad():
        rows_in = torch.cat([head.fuse(t["context_taps"]), t["hidden"]])[None]
        past_kv = [(t["past_key_0"].transpose(0, 1)[None], t["past_value_0"].transpose(0, 1)[None])]
        normed, t_prenorm, new = head(t["embeds"][None], rows_in, t["position_ids"][:, None], past_kv,
                                      rows_mask(t["attention_mask"], torch.float32))
        top, t_logp = log_softmax_top(head.logits(normed[0, t["logit_rows"]]), ids.shape[1])
    assert np.array_equal(ids, head.target_ids(top).numpy()) and np.all(ids % 4 == 0)
    assert np.abs(logp - t_logp.numpy()).max() < 1e-4
    assert np.abs(prenorm - t_prenorm[0].numpy()).max() < 1e-4
    assert np.abs(key - new[0][0][0].transpose(0, 1).numpy()).max() < 1e-4


def test_mrope_head_decodes_an_image_prompt_losslessly(mrope_export, images):
    _, _, out = mrope_export
    _check_image_decode(out, images)


def test_interleaved_mrope_head_exports_and_decodes(snapshot_dir, tmp_path, images):
    """Qwen3-VL's interleaved layout: the export's validation compares the graph with the torch head on three
    distinct axes, then an image prompt decodes losslessly."""
    snapshot = snapshot_dir("qwen3_vl")
    head = _head(snapshot, tmp_path / "head", mrope=True)
    assert head.config.rope.get("mrope_interleaved")
    out = export_artifacts(snapshot, tmp_path / "head", tmp_path / "out", max_tree=32, max_context=256,
                           progress=lambda _: None)
    assert read_manifest(out).head_mrope
    _check_image_decode(out, images)


def _check_image_decode(out: Path, images) -> None:
    backend = OrtBackend(out)
    codec = exported_codec(backend.manifest)
    prompt = codec.turn("What colour is the square?", images["tall"])
    ar = decode(backend, prompt, DecodeConfig(max_new_tokens=16, speculative=False)).tokens
    assert decode(backend, prompt, DecodeConfig(max_new_tokens=16, budget=31, branch_k=8)).tokens == ar
    seeded = decode(SeededDrafter(backend, ar, prompt.length, SEEDS["full"]), prompt,
                    DecodeConfig(max_new_tokens=16, budget=31, branch_k=8))
    assert seeded.tokens == ar and seeded.tau > 1


@pytest.mark.parametrize("variant", ["fp16", "int8", "int4"])
def test_reduced_precision_exports_decode(snapshot_dir, tmp_path, variant):
    """fp16 graphs and weight-only int8/int4 graphs (the step graph's matrices quantized too) decode as their own
    greedy decode does, with the head's drafts and with seeded ones. Quantized graphs keep fp32 activations here
    (--accuracy exact), where a tree pass equals one-row passes bit for bit: with int8 activations it may not, in
    the target's verify whatever the head, and that mode is gated by self-consistency elsewhere."""
    snapshot = snapshot_dir("qwen3")
    _head(snapshot, tmp_path / "head", drafted=DRAFTED)
    quantized = variant.startswith("int")
    out = export_artifacts(snapshot, tmp_path / "head", tmp_path / "out", max_tree=32, max_context=256,
                           dtype="fp16" if variant == "fp16" else "fp32", quantize=variant if quantized else None, group_size=32,
                           accuracy="exact", progress=lambda _: None)
    m = read_manifest(out)
    if quantized:
        assert m.quantization.tensorrt_graphs["draft"].file == "tensorrt/draft.onnx"
        assert json.loads((out / "manifest.json").read_text())["quantization"]["graphs"]["draft"]["MatMulNBits"] >= 7
    backend = OrtBackend(out)
    assert backend.head_kv.buffer.dtype == np.dtype(m.float_dtype)
    codec = exported_codec(m)
    prompt = codec.turn("What colour is the square?")
    ar = decode(backend, prompt, DecodeConfig(max_new_tokens=16, speculative=False)).tokens
    for budget, k in ((7, 1), (31, 8)):
        assert decode(backend, prompt, DecodeConfig(max_new_tokens=16, budget=budget, branch_k=k)).tokens == ar
    seeded = decode(SeededDrafter(backend, ar, prompt.length, SEEDS["partial"]), prompt,
                    DecodeConfig(max_new_tokens=16, budget=31, branch_k=8))
    assert seeded.tokens == ar and seeded.tau > 1


def test_a_head_with_its_own_embeddings_is_refused_in_one_line(snapshot_dir, tmp_path, capsys):
    snapshot = snapshot_dir("qwen3")
    _head(snapshot, tmp_path / "head", own_embeddings=True)
    code = export_main(["onnx", "--model", str(snapshot), "--head", str(tmp_path / "head"), "--out",
                        str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "embed_tokens" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_head_carrying_the_targets_own_embedding_borrows_it(snapshot_dir, tmp_path):
    """Published heads often save a copy of the target's input embedding: such a head exports (the graph borrows the
    target's table) and decodes as greedy does, with the torch reference's drafts on its own copy."""
    from glance_export.model.eagle3 import load_eagle3
    from glance_export.model.torch_backend import TorchBackend

    snapshot = snapshot_dir("qwen3")
    head = _head(snapshot, tmp_path / "head", own_embeddings=True)
    snap = Snapshot(snapshot)
    model = TorchBackend(snap).model
    with torch.no_grad():
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    save_eagle3(head, tmp_path / "head")
    out = export_artifacts(snapshot, tmp_path / "head", tmp_path / "out", max_tree=32, max_context=256,
                           progress=lambda _: None)
    prompt = snap.build_prompt("What colour is the square?", None)
    truth = decode(TorchBackend(snap, None, model=model), prompt, DecodeConfig(max_new_tokens=12, speculative=False))
    for backend in (OrtBackend(out), TorchBackend(snap, load_eagle3(tmp_path / "head"), model=model)):
        result = decode(backend, prompt, DecodeConfig(max_new_tokens=12, budget=15))
        assert result.tokens == truth.tokens and np.isfinite(result.tau)
