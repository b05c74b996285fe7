"""Every exported graph must parse and build under a real TensorRT compiler (TensorRT-RTX's CPU builder),
with the manifest's profiles: target prefill, tree verify (T 1..max_tree over past 0..max_context) and batch,
the vocabulary graph's embed and project passes, and the memory plan that sizes them for a device.

Artifacts come from the same per-session exports as test_onnx_export (fp32, fp16, external data)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from glance_export.model.adapters import Snapshot
from glance_export.build.targets import load_profile
from glance_export.build.local_gpu import BuildGpu
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.build.memory_plan import Limits, check_device_builds, kv_bytes_per_row, plan_memory
from glance_export.onnx import export_artifacts
from glance_export.build.precision import choose_precision
from glance_export.build.tensorrt_build import BuildOptions, build_engines, shape_profiles
from glance_export.build.engine_build import BuildRequest, build
from glance_export.build.toolchain import Toolchain, check_opset, load_toolchain
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import GraphFile, Manifest, Stack, read as load_manifest
from support import TENSORRT_RTX_MISSING, export_once

trt = pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
RTX = load_profile("rtx")


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    return lambda family, variant="fp32": export_once(snapshot_dir, tmp_path_factory, family, variant)[2]


def _build_all(artifacts: Path, out: Path, manifest: Manifest | None = None) -> set[str]:
    """Build every graph with TensorRT-RTX at the export's own precision (`manifest`: read before the files were
    changed); the graphs that built."""
    manifest = manifest or load_manifest(artifacts)
    out.mkdir()
    options = BuildOptions(choose_precision(RTX, None, manifest.dtype, BuildGpu(None)), workspace_gib=1)
    records = build_engines(load_toolchain(RTX), artifacts, manifest, out, options, progress=lambda _: None)
    assert set(records) == set(manifest.graphs) and all(r["bytes"] > 0 for r in records.values())
    return set(records)


@pytest.mark.parametrize("family,variant", [("qwen3_vl", "fp16"), ("qwen3", "external")])
def test_fp16_and_external_data_graphs_build(exported, tmp_path, family, variant):
    assert _build_all(exported(family, variant), tmp_path / "e") == {p.stem for p in (tmp_path / "e").glob("*.engine")}


def test_profiles_cover_prefill_tree_verify_and_vocab_passes(exported):
    manifest = load_manifest(exported("qwen2_5_vl"))
    prefill, verify, batch = shape_profiles(manifest, "target")
    assert prefill.axes["T"] == (1, 256, 256) and verify.axes["T"] == (1, 32, 32) and batch.axes["T"] == (1, 16, 32)
    assert prefill.axes["S"][0] == verify.axes["S"][0] == 0 and verify.axes["S"][2] == 255
    assert verify.axes["N_img"] == batch.axes["N_img"] == (0, 1, 1)
    assert prefill.axes["N_img"][2] == manifest.axes["N_img"][1]
    draft, _ = shape_profiles(manifest, "draft")
    assert draft.axes["N"][2] == 256 and draft.axes["S_h"] == (0, 127, 255)
    manifest = replace(manifest, axes={**manifest.axes, "E": (1, 2048), "R": (1, 63)})  # whatever the export has
    embed, project = shape_profiles(manifest, "vocab")
    assert embed.axes == {"E": (1, 256, 2048), "R": (1, 1, 1)} and project.axes == {"E": (1, 1, 1), "R": (1, 32, 63)}


def test_lowered_limits_shrink_every_axis_they_bound(exported):
    manifest = load_manifest(exported("qwen2_5_vl"))
    low = Limits(max_context=96, max_tree=16, max_image_tokens=40, max_batch=4).apply(manifest)
    prefill, verify, batch = shape_profiles(low, "target")
    assert prefill.axes["T"][2] == 96 and prefill.axes["S"][2] == 95 and verify.axes["T"][2] == 16
    assert prefill.axes["N_img"][2] == 40 and shape_profiles(low, "vision")[0].axes["N_merged"][2] == 40
    assert (low.max_context, low.max_tree, low.max_batch) == (96, 16, 4) and manifest.max_context == 256
    assert batch.axes == {"B": (1, 4, 4), "P": (1, 4, 4), "C_pool": (1, 96, 96), "T": (1, 16, 16), "S": (0, 47, 95),
                          "N_img": (0, 1, 1)}
    assert prefill.axes["P"] == verify.axes["P"] == (1, 1, 4) and prefill.axes["B"] == (1, 1, 1)
    raised = Limits(max_context=4096, max_tree=64, max_image_tokens=None, max_batch=64).apply(manifest)
    assert raised.axes == manifest.axes  # never above the export's bounds


WHOLE = 64  # --max-part-gib: the synthetic graphs below are sizes only, never cut into parts


def _synthetic_export(tmp_path: Path, weights_gib: float, dtype: str) -> Manifest:
    """The shipped manifest made a 28-layer target with GQA (4 KV heads of 128), no head, and its weights as one
    sparse file."""
    with open(tmp_path / "target.onnx", "wb") as fh:
        fh.truncate(int(weights_gib * (1 << 30)))
    return replace(load_manifest(DEFAULT_ARTIFACTS), path=tmp_path, dtype=dtype,
                   float_dtype="float16" if dtype == "fp16" else "float32", max_context=32768, max_tree=64,
                   axes={"T": (1, 32768), "S": (0, 32767)}, target=Stack(28, 4, 128), head=Stack(0, 0, 0),
                   graphs={"target": GraphFile("target.onnx", None, {})})


def test_memory_plan_derives_context_from_the_budget(tmp_path):
    manifest = _synthetic_export(tmp_path, 3.0, "fp16")
    orin = load_profile("jetson-orin")
    plan = plan_memory(orin, manifest, tmp_path, "fp16", BuildGpu(None), max_part_gib=WHOLE)
    per_row = kv_bytes_per_row(manifest)
    assert per_row == 2 * 28 * 4 * 128 * 2
    fit = int((orin.memory_gib - orin.reserve_gib - 3.0 - orin.workspace_gib) * (1 << 30) // per_row)
    assert plan.limits.max_context == fit // 256 * 256 and plan.reasons["max_context"] == "what fits the memory budget"
    assert plan.limits.max_tree == orin.max_tree and plan.total_gib <= plan.budget.usable_gib
    assert "max context" in plan.explain() and "jetson-orin default" in plan.explain()
    roomy = plan_memory(orin, manifest, tmp_path, "fp16", BuildGpu(None), memory_gib=64, max_part_gib=WHOLE)
    assert roomy.limits.max_context == 32768 and roomy.reasons["max_context"] == "the export's limit"
    on_device = plan_memory(orin, manifest, tmp_path, "fp16", BuildGpu("Jetson AGX Orin", "8.7", 30.6, "orin"),
                            max_part_gib=WHOLE)
    assert (on_device.budget.memory_gib, on_device.budget.source) == (30.6, "on this device")


def test_memory_plan_counts_weights_at_the_built_precision(tmp_path):
    manifest = _synthetic_export(tmp_path, 6.0, "fp32")
    thor = load_profile("jetson-thor")
    plan = plan_memory(thor, manifest, tmp_path, "fp16", BuildGpu(None), max_part_gib=WHOLE)
    assert plan.budget.weights_gib == pytest.approx(3.0)
    with pytest.raises(GlanceError, match=r"does not fit jetson-orin: .* GiB over the budget.*--workspace-gib"):
        plan_memory(load_profile("jetson-orin"), manifest, tmp_path, "fp32", BuildGpu(None), max_part_gib=WHOLE)


@pytest.mark.slow
def test_opset23_attention_graphs_validate_and_build(snapshot_dir, tmp_path):
    """The optional opset-23 export (dynamo, ONNX Attention op) passes ORT validation and TensorRT builds."""
    snap = Snapshot(snapshot_dir("qwen3"))
    head = save_head(init_head(head_config_for(snap, 2, 5, pick_mask_token(snap)), seed=1), tmp_path / "head")
    out = export_artifacts(snapshot_dir("qwen3"), head, tmp_path / "art23", opset=23, max_tree=16, max_context=128,
                           progress=lambda _: None)
    ops = {n.op_type for n in onnx.load(str(out / "target.onnx")).graph.node}
    assert "Attention" in ops and json.loads((out / "manifest.json").read_text())["opset"] == 23
    _build_all(out, tmp_path / "engines")
    # JetPack 6's TensorRT 10.3 parses opset <= 20 only (version simulated; refused before any build).
    orin = BuildGpu("NVIDIA Jetson AGX Orin", "8.7", 30.6, "orin")
    refusal = r"opset 23, and tensorrt 10\.3\.0 parses opset <= 20; re-export with `glance-export onnx --opset 17`"
    with pytest.raises(GlanceError, match=refusal):
        build(BuildRequest("jetson-orin", tmp_path / "orin", artifacts=out), orin, Toolchain(trt, "10.3.0"))
    check_opset(load_profile("jetson-orin"), 23, "10.14.1")
    assert not (tmp_path / "orin").exists()


def test_a_jetson_bundle_is_refused_where_the_device_cannot_build_it(tmp_path):
    """A 3 GiB graph built whole runs on an 8 GB Orin at a reduced context, but its builder (3.2 x 3 + 2 + 1 GiB)
    would not fit beside the OS; a 16 GB module builds it."""
    manifest = _synthetic_export(tmp_path, 3.0, "fp16")
    orin = load_profile("jetson-orin")
    plan = plan_memory(orin, manifest, tmp_path, "fp16", BuildGpu(None), max_part_gib=WHOLE)
    assert plan.build.gib == pytest.approx(3.2 * 3 + orin.workspace_gib + 1) and plan.build.graph == "target"
    with pytest.raises(GlanceError, match=r"jetson-orin with 8 GiB .* cannot build these engines on the device: "
                                          r"builder peak about 12\.60 GiB .* 6\.60 GiB over its 6 GiB; "
                                          r"pass --memory-gib"):
        check_device_builds(orin, plan)
    check_device_builds(orin, plan_memory(orin, manifest, tmp_path, "fp16", BuildGpu(None), memory_gib=16,
                                          max_part_gib=WHOLE))
    rtx = load_profile("rtx")
    check_device_builds(rtx, plan_memory(rtx, manifest, tmp_path, "fp16", BuildGpu(None), max_part_gib=WHOLE))


def test_a_graph_the_builder_rejects_is_one_line_naming_it(exported, tmp_path):
    """The worker's failure comes back as the parent's one-line error, and no engine is left behind."""
    artifacts = tmp_path / "art"
    artifacts.mkdir()
    for src in exported("qwen3").iterdir():
        (artifacts / src.name).write_bytes(src.read_bytes())
    manifest = load_manifest(artifacts)  # read whole: the hashes would refuse the cut graph before a worker
    (artifacts / "draft.onnx").write_bytes((artifacts / "draft.onnx").read_bytes()[:200])
    with pytest.raises(GlanceError, match=r"^TensorRT cannot build draft\.onnx: [^\n]+$"):
        _build_all(artifacts, tmp_path / "e", manifest)
    assert not (tmp_path / "e" / "draft.engine").exists()
