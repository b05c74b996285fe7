"""The builder's host memory: external weights handed to TensorRT's parser from a map of their file (the graph's
protobuf read without the onnx package), a mid-size graph's worker within the memory plan's estimate and the
build bound, the same engine as the parser reading the weights itself, and one-line refusals."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from glance_export.build.targets import load_profile
from glance_export.build.local_gpu import BuildGpu
from glance_export.build.engine_build import BuildRequest, build
from glance_export.build.mapped_weights import external_initializers
from glance_export.build.memory_plan import GIB, BuildPeak, build_peak, maps_weights
from glance_runtime.formats.artifacts import GraphFile
from glance_export.build.precision import choose_precision
from glance_export.build.tensorrt_build import BuildOptions, ShapeProfile, graph_job, run_job
from glance_runtime.errors import GlanceError
from support import TENSORRT_RTX_MISSING, export_once

pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
RTX = load_profile("rtx")
PROFILES = [ShapeProfile("prefill", {"T": (1, 256, 256)}), ShapeProfile("verify", {"T": (1, 32, 64)})]


def _mid_graph(path: Path, layers: int, width: int) -> float:
    """A target-like fp16 graph (residual MLP blocks over a [T, width] input), its weights in one data file;
    returns their GiB."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(layers):
        weights += [numpy_helper.from_array((rng.standard_normal(shape) * 0.02).astype(np.float16), f"{name}{i}")
                    for name, shape in (("up", (width, 4 * width)), ("down", (4 * width, width)))]
        nodes += [helper.make_node("MatMul", [x, f"up{i}"], [f"h{i}"]), helper.make_node("Relu", [f"h{i}"], [f"r{i}"]),
                  helper.make_node("MatMul", [f"r{i}", f"down{i}"], [f"d{i}"]),
                  helper.make_node("Add", [x, f"d{i}"], [f"y{i}"])]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "mid", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT16, ["T", width])], weights)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data",
                    size_threshold=0)
    return (path.parent / (path.name + ".data")).stat().st_size / GIB


def _build(onnx_path: Path, engine: Path, mapped: bool, progress=lambda _: None) -> float:
    """The worker's peak RSS in GiB; `mapped` False has the parser read the external weights itself."""
    options = BuildOptions(choose_precision(RTX, None, "fp16", BuildGpu(None)), workspace_gib=1)
    job = graph_job("tensorrt_rtx", onnx_path, engine, {"x": {"shape": ["T", 1024]}}, PROFILES, options, None,
                    external_data=mapped)
    return run_job(job, progress)


def test_external_initializers_are_read_as_onnx_reads_them(snapshot_dir, tmp_path_factory):
    _, _, artifacts = export_once(snapshot_dir, tmp_path_factory, "qwen3", "external")
    for entry in json.loads((artifacts / "manifest.json").read_text())["graphs"].values():
        model = onnx.load(str(artifacts / entry["file"]), load_external_data=False)
        expected = [(t.name, ExternalDataInfo(t).location, ExternalDataInfo(t).offset, ExternalDataInfo(t).length)
                    for t in model.graph.initializer if uses_external_data(t)]
        found = external_initializers((artifacts / entry["file"]).read_bytes())
        assert expected and [(t.name, t.location, t.offset, t.length) for t in found] == expected


@pytest.mark.slow
def test_mid_size_build_maps_its_weights_within_the_bound(tmp_path):
    """A 0.38 GiB graph with two profiles: referenced from the map, its worker stays within the estimate and
    under 1.5x the weights + 1 GiB, below the parser reading them itself, and
    writes the same engine byte for byte; each builder phase is a progress line with the resident memory."""
    weights = _mid_graph(tmp_path / "g.onnx", layers=24, width=1024)
    phases: list[str] = []
    mapped = _build(tmp_path / "g.onnx", tmp_path / "mapped.engine", mapped=True, progress=phases.append)
    parsed = _build(tmp_path / "g.onnx", tmp_path / "parsed.engine", mapped=False)
    assert (tmp_path / "mapped.engine").read_bytes() == (tmp_path / "parsed.engine").read_bytes()
    assert (tmp_path / "mapped.engine").stat().st_size > weights * GIB
    estimate = BuildPeak("g", weights, 0.0, mapped=True).gib
    assert mapped <= min(estimate, 1.5 * weights + 1), (mapped, estimate, weights)
    assert mapped <= parsed - 0.15 * weights, (mapped, parsed, weights)  # 0.3-0.7x measured, by machine load
    assert phases[0].startswith("Building engine (resident ") and phases[-1].startswith("Writing the serialized")
    assert sum("Determining refit engines" in line for line in phases) == len(PROFILES)


def test_truncated_weights_are_one_line_naming_the_file(tmp_path):
    _mid_graph(tmp_path / "g.onnx", layers=2, width=1024)
    data = tmp_path / "g.onnx.data"
    data.write_bytes(data.read_bytes()[:-4096])
    with pytest.raises(GlanceError, match=r"^TensorRT cannot build g\.onnx: g\.onnx\.data holds \d+ bytes and "
                                          r"g\.onnx reads down1 up to byte \d+ \(a truncated copy\?\); copy the "
                                          r"artifacts again$"):
        _build(tmp_path / "g.onnx", tmp_path / "g.engine", mapped=True)
    assert not (tmp_path / "g.engine").exists()


def test_the_estimate_maps_external_weights_only_where_the_parser_can(tmp_path):
    """TensorRT 10.13 added the parser's load_initializer: an Orin's 10.3 reads the weights itself, so its
    estimate counts them held; inline weights are held by every parser, so a smaller inline graph can be
    the costlier one."""
    (tmp_path / "target.onnx").write_bytes(b"\0" * 1024)
    with open(tmp_path / "target.onnx.data", "wb") as fh:
        fh.truncate(2 << 30)
    with open(tmp_path / "vision.onnx", "wb") as fh:
        fh.truncate(int(1.6 * (1 << 30)))
    graphs = {"target": GraphFile("target.onnx", "target.onnx.data", {}), "vision": GraphFile("vision.onnx", None, {})}
    orin, thor = load_profile("jetson-orin"), load_profile("jetson-thor")
    assert not maps_weights(orin, None) and not maps_weights(orin, "10.3.0") and maps_weights(thor, None)
    assert maps_weights(RTX, None) and maps_weights(orin, "10.13.2")
    held = build_peak(tmp_path, graphs, orin, 2.0, mapped=False)
    referenced = build_peak(tmp_path, graphs, thor, 4.0, mapped=True)
    assert (held.graph, held.mapped) == ("target", False) and held.gib == pytest.approx(3.2 * 2 + 2 + 1, abs=0.01)
    assert (referenced.graph, referenced.mapped) == ("vision", False)
    assert referenced.gib == pytest.approx(3.2 * 1.6 + 4 + 1, abs=0.01)
    assert referenced.gib > BuildPeak("target", 2, 4, mapped=True).gib
    assert "parsed weights of vision" in referenced.explain() and "parsed weights of target" in held.explain()


def test_refusal_before_any_worker_names_the_mapped_estimate(snapshot_dir, tmp_path_factory, tmp_path):
    """From the artifacts alone: external weights on TensorRT-RTX are estimated mapped, and a machine that
    cannot hold that is told the shortfall and what to change in one line, with nothing written."""
    _, _, artifacts = export_once(snapshot_dir, tmp_path_factory, "qwen3", "external")
    request = BuildRequest("rtx", tmp_path / "e", artifacts=artifacts, workspace_gib=1)
    with pytest.raises(GlanceError, match=r"^this machine has 0\.50 GiB of memory available and the build needs "
                                          r"about 1\.0\d GiB \(0\.5\d GiB short; builder peak about 1\.0\d GiB of "
                                          r"host memory \(2\.3 x the mapped weights of target, [\d.]+ MiB \+ 1 GiB "
                                          r"for the process\)\); free memory, build in smaller parts "
                                          r"\(--max-part-gib\), or build elsewhere: --plan-only writes a bundle "
                                          r"for a larger machine$"):
        build(request, BuildGpu(None), host_memory_gib=0.5, progress=lambda _: None)
    assert not (tmp_path / "e").exists()
    build(request, BuildGpu(None), host_memory_gib=1.5, progress=lambda _: None)
    plan = json.loads((tmp_path / "e" / "engines.json").read_text())["memory_plan"]
    assert plan["build_peak_graph"] == "target" and plan["build_peak_weights"] == "mapped"
