"""Every exported graph must parse and build under a real TensorRT compiler (TensorRT-RTX's CPU builder),
with the manifest's profiles: target prefill and tree verify (T 1..max_tree over past 0..max_context).

Artifacts come from the same per-session exports as test_onnx_export (fp32, fp16, external data)."""
from __future__ import annotations

import json

import onnx
import pytest

from glance_export.adapters import Snapshot
from glance_export.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_export.tensorrt_build import build_engines, profiles_for
from glance_runtime.errors import GlanceError
from test_onnx_export import export_once
from tiny_models import ALL_FAMILIES, VL_FAMILIES

pytest.importorskip("tensorrt_rtx")


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    return lambda family, variant="fp32": export_once(snapshot_dir, tmp_path_factory, family, variant)[2]


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_graph_builds(exported, tmp_path, family):
    sizes = build_engines(exported(family), tmp_path / "engines", workspace_gib=1, progress=lambda _: None)
    expected = {"target", "draft"} | ({"vision"} if family in VL_FAMILIES else set())
    assert set(sizes) == expected and all(size > 0 for size in sizes.values())
    assert {p.stem for p in (tmp_path / "engines").glob("*.engine")} == expected


@pytest.mark.parametrize("family,variant", [("qwen3_vl", "fp16"), ("qwen3", "external")])
def test_fp16_and_external_data_graphs_build(exported, family, variant):
    expected = {"target", "draft"} | ({"vision"} if family in VL_FAMILIES else set())
    assert set(build_engines(exported(family, variant), progress=lambda _: None)) == expected


def test_profiles_cover_prefill_and_tree_verify(exported):
    manifest = json.loads((exported("qwen2_5_vl") / "manifest.json").read_text())
    prefill, verify = profiles_for(manifest, "target")
    assert prefill.axes["T"] == (1, 256, 256) and verify.axes["T"] == (1, 32, 32)
    assert prefill.axes["S"][0] == verify.axes["S"][0] == 0 and verify.axes["S"][2] == 255
    assert verify.axes["N_img"] == (0, 1, 1) and prefill.axes["N_img"][2] == manifest["axes"]["N_img"][1]
    (draft,) = profiles_for(manifest, "draft")
    assert draft.axes["N"][2] == 256 and draft.axes["S_h"] == (0, 127, 255)


def test_opset23_attention_graphs_validate_and_build(snapshot_dir, tmp_path):
    """The optional opset-23 export (dynamo, ONNX Attention op) passes ORT validation and TensorRT builds."""
    snap = Snapshot(snapshot_dir("qwen3"))
    head = save_head(init_head(head_config_for(snap, 2, 5, pick_mask_token(snap)), seed=1), tmp_path / "head")
    out = export_artifacts(snapshot_dir("qwen3"), head, tmp_path / "art23", opset=23, max_tree=16, max_context=128,
                           progress=lambda _: None)
    ops = {n.op_type for n in onnx.load(str(out / "target.onnx")).graph.node}
    assert "Attention" in ops and json.loads((out / "manifest.json").read_text())["opset"] == 23
    assert set(build_engines(out, progress=lambda _: None)) == {"target", "draft"}


def test_missing_manifest_is_one_line_error(tmp_path):
    with pytest.raises(GlanceError, match="no manifest.json"):
        build_engines(tmp_path)
