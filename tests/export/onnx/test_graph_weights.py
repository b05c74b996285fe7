"""No weight is stored twice: the embedding and LM head live in the vocab graph only, a tied matrix stays
one tensor there, and the graphs together hold no more bytes than the weights they were exported from.

A folded transpose is the usual way a second copy sneaks in, so duplicates are found by the sorted
values of each tensor (a transposed or reshaped copy has the same multiset of values)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_export.onnx.external_data import graph_tensors
from support import make_snapshot, tiny_head

LARGE = 4096  # bytes; smaller constants (rotary tables, shape tensors) may legitimately repeat


def _tensors(artifacts: Path) -> dict[str, list[np.ndarray]]:
    """Every graph's tensors."""
    manifest = json.loads((artifacts / "manifest.json").read_text())
    out = {}
    for graph, entry in manifest["graphs"].items():
        model = onnx.load(str(artifacts / entry["file"]))
        out[graph] = [numpy_helper.to_array(t) for t in graph_tensors(model.graph)]
    return out


def _fingerprint(array: np.ndarray) -> str:
    return hashlib.sha256(np.sort(array.ravel()).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(snapshot dir, head dir, artifacts) per (family, tied)."""
    built = {}

    def get(family: str, tied: bool):
        if (family, tied) not in built:
            root = tmp_path_factory.mktemp(f"weights_{family}_{tied}")
            snap_dir = make_snapshot(root / "snapshot", family, tied=tied)
            snap = Snapshot(snap_dir)
            head = save_head(init_head(head_config_for(snap, 1, 6, pick_mask_token(snap)), seed=0), root / "head")
            artifacts = export_artifacts(snap_dir, head, root / "artifacts", max_tree=16, max_context=64,
                                         progress=lambda _: None)
            built[family, tied] = (snap_dir, head, artifacts)
        return built[family, tied]

    return get


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_no_tensor_is_stored_twice(exports, family, tied):
    _, _, artifacts = exports(family, tied)
    seen: dict[str, str] = {}
    for graph, tensors in _tensors(artifacts).items():
        for array in tensors:
            if array.nbytes < LARGE:
                continue
            key = _fingerprint(array)
            assert key not in seen, f"a {array.shape} tensor of the {graph} graph repeats one of the {seen.get(key)} graph"
            seen[key] = graph


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_vocabulary_matrices_live_in_the_vocab_graph_only(exports, family, tied):
    snap_dir, _, artifacts = exports(family, tied)
    tc = Snapshot(snap_dir).text_config
    vocab_shape = {(tc["vocab_size"], tc["hidden_size"]), (tc["hidden_size"], tc["vocab_size"])}
    counts = {graph: sum(a.shape in vocab_shape for a in tensors) for graph, tensors in _tensors(artifacts).items()}
    assert counts.pop("vocab") == (1 if tied else 2)
    assert set(counts.values()) == {0}
    vocab = onnx.load(str(artifacts / "vocab.onnx"), load_external_data=False).graph
    gemms = [n for n in vocab.node if n.op_type == "Gemm"]
    assert len(gemms) == 1 and {a.name: a.i for a in gemms[0].attribute}["transB"] == 1
    assert json.loads((artifacts / "manifest.json").read_text())["graphs"]["vocab"]["tied"] is tied


@pytest.mark.parametrize("tied", [True, False])
def test_graph_tensors_add_up_to_the_weights(exports, tied):
    """No weight stored twice (graph tensors at most 1.05x the target's and the head's weights), on tensor bytes: a tiny
    graph's node structure outweighs its weights, which benchmarks/graph_bytes.py measures at real width."""
    snap_dir, head, artifacts = exports("qwen2_5_vl", tied)
    stored = sum(a.nbytes for tensors in _tensors(artifacts).values() for a in tensors)
    weights = sum(p.stat().st_size for p in snap_dir.glob("*.safetensors")) + (head / "model.safetensors").stat().st_size
    assert stored <= 1.05 * weights, f"graphs hold {stored} tensor bytes for {weights} bytes of weights"


@pytest.mark.parametrize("scheme", [None, "int4"])
def test_an_export_stores_each_weight_once_in_every_form(snapshot_dir, tmp_path, scheme):
    """One target and one draft graph serve a lone sequence and a batch: no second set of graphs, and across every
    graph file of a form (the ONNX Runtime graphs; int4's TensorRT graphs under tensorrt/) no two weights hold the
    same bytes."""
    snapshot = snapshot_dir("qwen3")
    out = export_artifacts(snapshot, tiny_head(snapshot, tmp_path / "head"), tmp_path / "out", max_tree=8,
                           max_context=64, max_batch=4, quantize=scheme, group_size=32 if scheme else None,
                           progress=lambda _: None)
    assert not list(out.rglob("*_batch*"))
    forms = [out, out / "tensorrt"] if scheme else [out]
    assert all(form.is_dir() for form in forms)
    for form in forms:
        seen: dict[str, str] = {}
        for path in sorted(form.glob("*.onnx")):
            for tensor in graph_tensors(onnx.load(str(path)).graph):
                data = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
                if len(data) < LARGE:
                    continue
                key = hashlib.sha256(data).hexdigest()
                where = f"{path.relative_to(out)}:{tensor.name}"
                assert key not in seen, f"{where} holds the same bytes as {seen.get(key)}"
                seen[key] = where
        assert any("target.onnx" in w for w in seen.values()) and any("draft.onnx" in w for w in seen.values())
