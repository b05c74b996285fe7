"""Every exported graph must parse and build under a real TensorRT compiler (TensorRT-RTX's CPU builder),
with the manifest's profiles: target prefill and tree verify (T 1..max_tree over past 0..max_context)."""
from __future__ import annotations

import json

import pytest

from glance_export.adapters import Snapshot
from glance_export.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_export.tensorrt_build import build_engines, profiles_for
from glance_runtime.errors import GlanceError
from tiny_models import ALL_FAMILIES, VL_FAMILIES

pytest.importorskip("tensorrt_rtx")


def _export(snapshot_dir, root, family: str, dtype: str = "fp32"):
    snap = Snapshot(snapshot_dir(family))
    head = save_head(init_head(head_config_for(snap, 2, 5, pick_mask_token(snap)), seed=1), root / f"head_{family}")
    return export_artifacts(snapshot_dir(family), head, root / f"art_{family}_{dtype}", dtype=dtype, max_tree=32,
                            max_context=256, progress=lambda _: None)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_graph_builds(snapshot_dir, tmp_path, family):
    out = _export(snapshot_dir, tmp_path, family)
    sizes = build_engines(out, tmp_path / "engines", workspace_gib=1, progress=lambda _: None)
    expected = {"target", "draft"} | ({"vision"} if family in VL_FAMILIES else set())
    assert set(sizes) == expected and all(size > 0 for size in sizes.values())
    assert {p.stem for p in (tmp_path / "engines").glob("*.engine")} == expected


def test_fp16_graphs_build(snapshot_dir, tmp_path):
    out = _export(snapshot_dir, tmp_path, "qwen3_vl", dtype="fp16")
    assert set(build_engines(out, progress=lambda _: None)) == {"target", "draft", "vision"}


def test_profiles_cover_prefill_and_tree_verify(snapshot_dir, tmp_path):
    manifest = json.loads((_export(snapshot_dir, tmp_path, "qwen2_5_vl") / "manifest.json").read_text())
    prefill, verify = profiles_for(manifest, "target")
    assert prefill.axes["T"] == (1, 256, 256) and verify.axes["T"] == (1, 32, 32)
    assert prefill.axes["S"][0] == verify.axes["S"][0] == 0 and verify.axes["S"][2] == 255
    assert verify.axes["N_img"] == (0, 1, 1) and prefill.axes["N_img"][2] == manifest["axes"]["N_img"][1]
    (draft,) = profiles_for(manifest, "draft")
    assert draft.axes["N"][2] == 256 and draft.axes["S_h"] == (0, 127, 255)


def test_missing_manifest_is_one_line_error(tmp_path):
    with pytest.raises(GlanceError, match="no manifest.json"):
        build_engines(tmp_path)


def test_external_data_graphs_build(snapshot_dir, tmp_path, monkeypatch):
    from glance_export.onnx import export as export_mod

    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_BYTES", 0)
    out = _export(snapshot_dir, tmp_path, "qwen3")
    assert (out / "target.onnx.data").is_file()
    assert set(build_engines(out, progress=lambda _: None)) == {"target", "draft"}
