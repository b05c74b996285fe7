"""A head with a reduced draft vocabulary exports a draft_vocab graph: the target's embedding and LM head rows of
its N tokens (one tensor when tied) and the map back to target ids. ONNX Runtime drafts through it exactly what
the torch reference drafts, int4 quantizes it like the vocab graph, and TensorRT builds it. Every backend
projects only the draft rows a tree of the round's budget can reach."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from glance_export.onnx import export_artifacts
from glance_runtime.backends.registry import Source, open_session
from support import TENSORRT_RTX_MISSING, make_snapshot, tiny_head

N = 40


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_vocab")
    snap = make_snapshot(root / "snap", "qwen2", tied=request.param)
    head = tiny_head(snap, root / "head", draft_vocab=N)
    art = export_artifacts(snap, head, root / "art", max_tree=16, max_context=128, progress=lambda _: None)
    return snap, head, art, request.param


def test_the_graph_holds_the_n_rows_once_when_tied_and_is_recorded(exported):
    _, _, art, tied = exported
    graphs = json.loads((art / "manifest.json").read_text())["graphs"]
    assert graphs["draft_vocab"]["vocab_size"] == N and graphs["draft_vocab"]["tied"] is tied
    model = onnx.load(str(art / "draft_vocab.onnx"))
    floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert sorted(tuple(t.dims) for t in floats) == [(N, 64)] * (1 if tied else 2)
    id_map = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT64 and tuple(t.dims) == (N,)]
    assert len(id_map) == 1 and onnx.numpy_helper.to_array(id_map[0]).max() > N  # target ids, not draft indices


def test_onnx_runtime_drafts_what_the_torch_reference_drafts_at_every_depth(exported):
    snap, head, art, _ = exported
    torch_side = open_session(Source("torch", model=snap, head=head)).backend
    graphs = open_session(Source("onnxruntime", artifacts=art)).backend
    clock = graphs.time_graphs()
    prompt = open_session(Source("torch", model=snap, head=head)).prompt("Count to ten.")
    drafts = {}
    for name, backend in (("torch", torch_side), ("onnxruntime", graphs)):
        for depth in (None, 2, 99):
            anchor = backend.prefill(prompt).first
            drafts[name, depth] = backend.draft(anchor, 4, depth)
    ids, _ = drafts["torch", None]
    assert ids.shape == (5, 4) and set(ids.reshape(-1).tolist()) <= set(tiny_ids(head))
    for depth, rows in ((None, 5), (2, 2), (99, 5)):  # a shallow draft runs a short block: both backends alike
        (got_ids, got_logp), (ref_ids, ref_logp) = drafts["onnxruntime", depth], drafts["torch", depth]
        assert ref_ids.shape == (rows, 4)
        np.testing.assert_array_equal(got_ids, ref_ids)
        np.testing.assert_allclose(got_logp, ref_logp, atol=1e-4)
    np.testing.assert_array_equal(drafts["torch", 99][0], ids)
    assert clock.runs()["draft_vocab"] == 3  # every draft projected through it, none through the vocab graph's


def tiny_ids(head) -> list[int]:
    from glance_export.model.head import load_head

    return load_head(head).draft_vocab_ids.tolist()


def test_int4_quantizes_it_like_the_vocab_graph(exported, tmp_path):
    snap, head, _, tied = exported
    art = export_artifacts(snap, head, tmp_path / "int4", max_tree=16, max_context=128, quantize="int4",
                           group_size=32, progress=lambda _: None)
    record = json.loads((art / "manifest.json").read_text())["quantization"]["graphs"]["draft_vocab"]
    assert record["MatMulNBits"] == 1 and record["GatherBlockQuantized"] == 2 and record["tied"] is tied
    ops = {n.op_type for n in onnx.load(str(art / "draft_vocab.onnx")).graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops and "Gemm" not in ops
    backend = open_session(Source("onnxruntime", artifacts=art)).backend
    anchor = backend.prefill(open_session(Source("torch", model=snap, head=head)).prompt("Hi")).first
    ids, _ = backend.draft(anchor, 4)
    assert set(ids.reshape(-1).tolist()) <= set(tiny_ids(head))


def test_tensorrt_builds_it(exported, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    from glance_export.build.local_gpu import BuildGpu
    from glance_export.build.precision import choose_precision
    from glance_export.build.targets import load_profile
    from glance_export.build.tensorrt_build import BuildOptions, build_engines, shape_profiles
    from glance_export.build.toolchain import load_toolchain
    from glance_runtime.formats.artifacts import read as load_manifest

    _, _, art, _ = exported
    manifest = load_manifest(art)
    (project,) = shape_profiles(manifest, "draft_vocab")
    assert project.axes["E"] == (1, 1, 1)
    rtx = load_profile("rtx")
    out = tmp_path / "engines"
    out.mkdir()
    options = BuildOptions(choose_precision(rtx, None, manifest.dtype, BuildGpu(None)), workspace_gib=1)
    records = build_engines(load_toolchain(rtx), art, manifest, out, options, progress=lambda _: None)
    assert records["draft_vocab"]["bytes"] > 0 and (out / "draft_vocab.engine").is_file()
