"""An EAGLE-3 export builds under a real TensorRT compiler (TensorRT-RTX's CPU builder): its target for one sequence
(no batch profile), its draft step graph with a root profile (committed rows through fc, the last projected) and a
step profile (one depth's nodes), and the memory plan's lowered limits keep the rows an EAGLE-3 round caches beyond
the context."""
from __future__ import annotations

import pytest

from glance_export.build.local_gpu import BuildGpu
from glance_export.build.memory_plan import Limits
from glance_export.build.precision import choose_precision
from glance_export.build.targets import load_profile
from glance_export.build.tensorrt_build import BuildOptions, build_engines, shape_profiles
from glance_export.build.toolchain import load_toolchain
from glance_export.onnx import export_artifacts
from glance_runtime.formats.artifacts import read as load_manifest
from support import TENSORRT_RTX_MISSING, tiny_eagle3_head

trt = pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)


@pytest.fixture(scope="module")
def eagle3_artifacts(snapshot_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_build")
    head = tiny_eagle3_head(snapshot_dir("qwen2_5_vl"), root / "head", draft_vocab=64, mrope=True)
    return export_artifacts(snapshot_dir("qwen2_5_vl"), head, root / "artifacts", max_tree=32, max_context=256,
                            progress=lambda _: None)


def test_the_draft_step_graph_has_a_root_and_a_step_profile(eagle3_artifacts):
    manifest = load_manifest(eagle3_artifacts)
    root, step = shape_profiles(manifest, "draft")
    assert root.axes["M"] == (0, 0, 0) and root.axes["Q"] == (1, 1, 1) and root.axes["N_taps"][2] == 256
    assert step.axes["N_taps"] == (0, 0, 0) and step.axes["M"][2] == step.axes["Q"][2] == manifest.branch_k
    for profile in (root, step):
        assert profile.axes["S_h"][2] == manifest.axes["S_h"][1] > manifest.max_context
        assert profile.axes["C"][2] == manifest.axes["C"][1]


def test_the_target_engine_serves_one_sequence(eagle3_artifacts):
    """An EAGLE-3 export bounds the batch to 1: the target engine has a lone sequence's profiles only, over a
    one-slot pool."""
    manifest = load_manifest(eagle3_artifacts)
    profiles = shape_profiles(manifest, "target")
    assert [p.name for p in profiles] == ["prefill", "verify"]
    assert all(p.axes["B"] == p.axes["P"] == (1, 1, 1) for p in profiles)


def test_lowered_limits_keep_the_rows_a_round_caches_beyond_the_context(eagle3_artifacts):
    manifest = load_manifest(eagle3_artifacts)
    low = Limits(max_context=96, max_tree=16, max_image_tokens=None).apply(manifest)
    beyond = manifest.axes["S_h"][1] - manifest.max_context
    assert beyond > 0 and low.axes["S_h"][1] == 96 + beyond
    assert low.axes["C"][1] == 96 + manifest.axes["C"][1] - manifest.max_context
    assert low.axes["N_taps"][1] == low.axes["R_h"][1] == 96


def test_every_graph_builds(eagle3_artifacts, tmp_path):
    manifest = load_manifest(eagle3_artifacts)
    rtx = load_profile("rtx")
    options = BuildOptions(choose_precision(rtx, None, manifest.dtype, BuildGpu(None)), workspace_gib=1)
    records = build_engines(load_toolchain(rtx), eagle3_artifacts, manifest, tmp_path, options,
                            progress=lambda _: None)
    assert set(records) == set(manifest.graphs) and "draft" in records
    assert all(r["bytes"] > 0 for r in records.values())
