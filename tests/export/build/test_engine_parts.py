"""A graph built as a chain of parts: the cut (consecutive nodes, boundaries inside a layer, cheap values
recomputed), the chain that runs the parts as one graph (the same class the TensorRT backend uses, run here
on ONNX Runtime over host buffers) decoding token for token as the whole graph does, the TensorRT-RTX build
of the parts with engines.json listing them, the memory plan's per-part estimate, and one-line refusals."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest

from glance_export.build.targets import load_profile
from glance_export.build.local_gpu import BuildGpu
from glance_export.build.engine_build import BuildRequest, build
from glance_export.build.engine_parts import GraphCut, cut_budget
from glance_export.build.memory_plan import GIB, BuildPeak, Budget, graph_bytes, part_budget_gib, plan_memory
from glance_runtime.backends.ort_backend import OrtBackend, OrtGraph
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.errors import GlanceError
from glance_runtime.formats import engines as engines_format
from glance_runtime.formats.artifacts import read as load_manifest
from glance_runtime.backends.graph_chain import ChainGraph, Part
from glance_runtime.store.integrity import verify_engines
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.codec import exported_codec
from support import TENSORRT_RTX_MISSING, export_once

MAX_NEW = 20
RTX = load_profile("rtx")
NO_GPU = BuildGpu(None)
LAYER = re.compile(r"/layers\.(\d+)/")


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory):
    return lambda family: export_once(snapshot_dir, tmp_path_factory, family)[2]


def _layer(node) -> str | None:
    found = LAYER.search(node.name)
    return found[1] if found else None


def _target_cut(artifacts: Path, parts: int) -> GraphCut:
    size = graph_bytes(artifacts, load_manifest(artifacts).graphs)["target"]
    return GraphCut(artifacts / "target.onnx", cut_budget(size, size // parts))


def _chained(artifacts: Path, cut: GraphCut, scratch: Path) -> tuple[OrtBackend, ChainGraph]:
    """An ONNX Runtime backend whose target graph is the chain of the cut's part files."""
    backend = OrtBackend(artifacts)
    scratch.mkdir()
    parts = [Part(OrtGraph(ort.InferenceSession(str(p.onnx), providers=["CPUExecutionProvider"]), backend.device),
                  tuple(p.inputs), tuple(p.outputs), p.onnx.name) for p in cut.write(scratch, "target")]
    chain = ChainGraph(parts, backend.device)
    backend.graphs["target"] = chain
    return backend, chain


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_chained_target_decodes_as_the_whole_graph(exported, images, tmp_path, family):
    """AR and GLANCE (seeded partial acceptance: trees of every depth verified) give the whole graph's tokens
    and rounds, with cuts inside a layer; the buffers between parts are sized by the passes, reused by a
    second decode and grown by a longer prompt."""
    artifacts = exported(family)
    cut = _target_cut(artifacts, parts=4)
    assert len(cut.segments) >= 3
    layers = [(_layer(before.nodes[-1]), _layer(after.nodes[0])) for before, after in zip(cut.runs, cut.runs[1:])]
    assert any(a is not None and a == b for a, b in layers), f"every cut fell between layers: {layers}"
    whole = OrtBackend(artifacts)
    chained, chain = _chained(artifacts, cut, tmp_path / "parts")
    assert chain.input_names == whole.graphs["target"].input_names
    prompt = exported_codec(whole.manifest).turn("What colour is the square?", images["wide"])
    ar = DecodeConfig(max_new_tokens=MAX_NEW, speculative=False)
    truth = decode(whole, prompt, ar).tokens
    assert decode(chained, prompt, ar).tokens == truth
    held, buffers = chain.held_bytes(), dict(chain._buffers)
    assert held > 0
    spec = DecodeConfig(max_new_tokens=MAX_NEW, budget=31, branch_k=8)
    runs = {name: decode(SeededDrafter(b, truth, prompt.length, lambda d: 0 if d % 3 else 1), prompt, spec)
            for name, b in (("whole", whole), ("chained", chained))}
    assert runs["chained"].tokens == runs["whole"].tokens == truth
    assert [r.accepted for r in runs["chained"].rounds] == [r.accepted for r in runs["whole"].rounds]
    assert max(r.accepted for r in runs["chained"].rounds) >= 2
    assert chain._buffers == buffers and chain.held_bytes() == held  # the prompt's prefill was the largest pass
    longer = exported_codec(whole.manifest).turn("What colour is the square? " * 4, images["large"])
    assert decode(chained, longer, ar).tokens == decode(whole, longer, ar).tokens
    assert chain.held_bytes() > held
    chained.close()
    assert chain.held_bytes() == 0


def test_parts_pass_only_floating_tensors_and_recompute_the_rest(exported):
    """What crosses a cut is a float tensor with dims in the graph's axes; masks, rotary tables and shape
    arithmetic are recomputed by the parts that read them; every part reads what it is given."""
    artifacts = exported("qwen2_5_vl")
    cut = _target_cut(artifacts, parts=4)
    made: set[str] = set()
    graph_inputs = {i.name for i in cut.model.graph.input}
    for number, (inputs, outputs) in enumerate(cut.boundaries):
        passed = [n for n in inputs if n not in graph_inputs]
        assert all(n in made for n in passed) and (number == 0 or passed)
        assert all(cut.types[n].tensor_type.elem_type == 1 for n in passed)  # float32 export
        made |= set(outputs)
    assert {o.name for o in cut.model.graph.output} <= made
    assert sum(cut.part_bytes) >= sum(r.weight_bytes for r in cut.runs)
    attending = [inputs for (inputs, _), part in zip(cut.boundaries, cut.segments)
                 if any(node.op_type == "Softmax" for node in part.nodes)]
    assert len(attending) > 1 and all("tree_mask" in inputs for inputs in attending)  # each rebuilds the mask


def test_a_forced_part_budget_builds_a_chain_of_engines(exported, tmp_path):
    """TensorRT-RTX builds every part; engines.json lists them in order with what each reads and writes, the
    integrity check covers each file, the plan estimated the largest part, and no part protobuf is left in
    the artifacts or the engines."""
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    artifacts = exported("qwen2_5_vl")
    before = sorted(p.name for p in artifacts.iterdir())
    target_gib = graph_bytes(artifacts, load_manifest(artifacts).graphs)["target"] / GIB
    out = tmp_path / "engines"
    lines: list[str] = []
    build(BuildRequest("rtx", out, artifacts=artifacts, max_part_gib=target_gib / 3), NO_GPU, progress=lines.append)
    assert sorted(p.name for p in artifacts.iterdir()) == before
    assert not list(out.glob("*.onnx")) and not list(out.glob("*.data"))
    record = engines_format.read(out)
    parts = record.engines["target"]
    assert len(parts) >= 3 and [p.file for p in parts] == [f"target.part{i}.engine" for i in range(1, len(parts) + 1)]
    raw = record.raw
    assert set(raw["engines"]["target"]) >= {"parts", "onnx", "profiles", "build_s", "peak_rss_gib"}
    graph_inputs = set(load_manifest(artifacts).graphs["target"].inputs)
    written: set[str] = set()
    for part in parts:
        assert set(part.inputs) - written <= graph_inputs and part.outputs
        written |= set(part.outputs)
    verify_engines(out, record.files)
    plan = raw["memory_plan"]
    largest = max(plan["parts_gib"]["target"])
    assert plan["build_peak_part"].startswith("part ") and plan["part_gib"] == pytest.approx(target_gib / 3)
    assert plan["build_peak_gib"] == pytest.approx(BuildPeak("target", largest, 0.0).gib, abs=1e-3) or \
        plan["build_peak_graph"] != "target"
    peaks = [p["peak_rss_gib"] for p in raw["engines"]["target"]["parts"]]
    assert all(0.05 < peak < plan["build_peak_gib"] for peak in peaks)
    assert any("in parts, chained at run time" in line for line in lines)
    assert any(f"wrote {sum(len(v) for v in record.engines.values())} engines for" in line for line in lines)


@pytest.fixture(scope="module")
def chained_engines(exported, tmp_path_factory):
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    artifacts = exported("qwen3")
    size = graph_bytes(artifacts, load_manifest(artifacts).graphs)["target"]
    out = tmp_path_factory.mktemp("chained") / "engines"
    build(BuildRequest("rtx", out, artifacts=artifacts, max_part_gib=size / 2 / GIB), NO_GPU, progress=lambda _: None)
    return out


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "target.part2.engine").unlink(), r"target\.part2\.engine is missing; rebuild"),
    (lambda d: (d / "target.part1.engine").write_bytes((d / "target.part1.engine").read_bytes()[:-1] + b"\0"),
     r"target\.part1\.engine does not match the sha256"),
    (lambda d: (d / "target.part2.engine").write_bytes(b"x"), r"target\.part2\.engine is 1 bytes but"),
])
def test_a_damaged_or_missing_part_is_one_line(chained_engines, tmp_path, damage, message):
    from glance_runtime.backends.trt_backend import TrtBackend

    copy = Path(shutil.copytree(chained_engines, tmp_path / "engines"))
    damage(copy)
    with pytest.raises(GlanceError, match=message) as err:
        TrtBackend(copy)
    assert "\n" not in str(err.value) and "glance-export build" in str(err.value)


def test_the_plan_estimates_the_largest_part_and_a_jetson_lowers_the_budget(exported):
    artifacts = exported("qwen2_5_vl")
    manifest = load_manifest(artifacts)
    sizes = graph_bytes(artifacts, manifest.graphs)
    whole = plan_memory(RTX, manifest, artifacts, "fp32", NO_GPU)
    assert whole.cuts == {} and whole.build.part == "" and "every graph whole" in whole.explain()
    split = plan_memory(RTX, manifest, artifacts, "fp32", NO_GPU, max_part_gib=sizes["target"] / 4 / GIB)
    cut = split.cuts["target"]
    assert len(cut.part_bytes) >= 4 and max(cut.part_bytes) <= sizes["target"] / 3
    assert split.build.gib < whole.build.gib
    assert f"target in {len(cut.part_bytes)} parts of at most" in split.explain()
    assert split.record()["parts_gib"]["target"] == [round(b / GIB, 4) for b in cut.part_bytes]
    # An 8 GB Orin: a part's worker (3.2 x part + 2 GiB workspace + 1 GiB) fits its 6 usable GiB.
    orin = load_profile("jetson-orin")
    nano = Budget(8, "test", orin.reserve_gib, orin.workspace_gib, 1.0, 0)
    part = part_budget_gib(orin, nano, mapped=False, requested=None)
    assert part == pytest.approx((nano.usable_gib - orin.workspace_gib - 1) / 3.2, abs=0.01) and part < 2
    assert part_budget_gib(orin, Budget(64, "test", orin.reserve_gib, 2, 1.0, 0), False, None) == 2.0
    assert part_budget_gib(RTX, nano, True, None) == 2.0 and part_budget_gib(orin, nano, False, 0.5) == 0.5


def test_cut_budgets_share_a_graph_evenly():
    assert cut_budget(1 << 30, 2 << 30) is None
    assert cut_budget(5 << 30, 2 << 30) == -(-(5 << 30) // 3)
    assert cut_budget(12 << 30, 2 << 30) == 2 << 30


def test_a_chain_refuses_a_part_reading_what_nothing_gives(exported, tmp_path):
    artifacts = exported("qwen3")
    backend, chain = _chained(artifacts, _target_cut(artifacts, parts=2), tmp_path / "parts")
    chain.parts[1] = Part(chain.parts[1].graph, chain.parts[1].inputs + ("nowhere",), chain.parts[1].outputs,
                          chain.parts[1].name)
    prompt = exported_codec(backend.manifest).turn("What colour is the square?")
    with pytest.raises(GlanceError, match=r"^target\.part2\.onnx reads nowhere, which neither the pass nor an earlier "
                                          r"part gives; rebuild the engines$"):
        backend.prefill(prompt)
