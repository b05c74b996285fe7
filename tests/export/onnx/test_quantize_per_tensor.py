"""The per-tensor quantizer against ONNX Runtime's whole-graph `MatMulNBitsQuantizer` (the library as the
oracle): the same nodes, names, attributes, integers and scales, on graphs with data files (vocabulary
matrices in chunks of rows) and on exported ones, tied and untied; the TensorRT form's integers are the
same blocks with positive scales; and the quantize step's resident peak does not grow with depth."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer,
                                                             MatMulNBitsQuantizer)

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_export.onnx.checkpoint import Checkpoint
from glance_export.onnx.memory import GIB, check_fits, estimate_peak
from glance_export.onnx.quantize import STAGING, check_scheme, quantize_graph
from glance_export.onnx.rewrite import skip_identities
from glance_runtime.errors import GlanceError
from support import make_mid_snapshot, make_snapshot

ROOT = Path(__file__).resolve().parents[3]
H, F, V = 64, 96, 50


def _save(model: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{path.name}.data", size_threshold=0)


def _small_graphs(out: Path, tied: bool) -> None:
    """A vocab graph (embedding Gather, LM head Gemm) and a target graph (MatMuls, one weight read through an
    Identity, one read by two MatMuls, a bias), both with their weights in a data file."""
    rng = np.random.default_rng(7)
    w = lambda *shape: numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), None)  # noqa: E731
    table = w(V, H)
    table.name = "model.embed_tokens.weight"
    inits = [table]
    head = table.name
    if not tied:
        inits.append(w(V, H))
        inits[-1].name = head = "lm_head.weight"
    vocab = helper.make_graph(
        [helper.make_node("Gather", [table.name, "ids"], ["embeds"]),
         helper.make_node("Gemm", ["hidden", head], ["logits"], transB=1)], "vocab",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["m", H])],
        [helper.make_tensor_value_info("embeds", TensorProto.FLOAT, ["n", H]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["m", V])], inits)
    _save(helper.make_model(vocab, opset_imports=[helper.make_opsetid("", 17)]), out / "vocab.onnx")
    names = {"model.layers.0.up": (H, F), "model.layers.0.down": (F, H), "model.layers.1.q": (H, H)}
    weights = []
    for name, shape in names.items():
        weights.append(w(*shape))
        weights[-1].name = name
    bias = w(H)
    bias.name = "model.norm.bias"
    target = helper.make_graph(
        [helper.make_node("Identity", ["model.layers.0.up"], ["up_alias"]),
         helper.make_node("MatMul", ["x", "up_alias"], ["a"], name="up"),
         helper.make_node("MatMul", ["a", "model.layers.0.down"], ["b"], name="down"),
         helper.make_node("MatMul", ["b", "model.layers.1.q"], ["c"], name="q_block"),
         helper.make_node("MatMul", ["x", "model.layers.1.q"], ["d"], name="q_context"),
         helper.make_node("Add", ["c", "d"], ["e"]), helper.make_node("Add", ["e", bias.name], ["y"])], "target",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", H])], [*weights, bias])
    _save(helper.make_model(target, opset_imports=[helper.make_opsetid("", 17)]), out / "target.onnx")


def _oracle(path: Path, name: str, bits: int, group: int, accuracy_level: int) -> onnx.ModelProto:
    """The whole graph through ONNX Runtime's quantizer, the LM head first as the MatMul on W^T it computes."""
    model = onnx.load(str(path))
    skip_identities(model, {t.name for t in model.graph.initializer})
    graph = model.graph
    for i, node in enumerate(graph.node):
        if node.op_type == "Gemm":
            weight = next(t for t in graph.initializer if t.name == node.input[1])
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T),
                                                             f"{weight.name}.T"))
            graph.node.remove(node)
            graph.node.insert(i, helper.make_node("MatMul", [node.input[0], f"{weight.name}.T"], list(node.output),
                                                  name="lm_head_matmul"))
            break
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=group, is_symmetric=True,
                                     accuracy_level=accuracy_level or None, op_types_to_quantize=("MatMul",))
    quantizer.process()
    return quantizer.model.model


def _arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _assert_as_the_library(ours_dir: Path, fp32_dir: Path, name: str, bits: int, group: int,
                           accuracy_level: int) -> None:
    theirs = _oracle(fp32_dir / f"{name}.onnx", name, bits, group, accuracy_level)
    ours = onnx.load(str(ours_dir / f"{name}.onnx"))
    mine, lib = _arrays(ours), _arrays(theirs)
    expected = {n.name: n for n in theirs.graph.node if n.op_type == "MatMulNBits"}
    got = {n.name: n for n in ours.graph.node if n.op_type == "MatMulNBits"}
    assert sorted(got) == sorted(expected) and expected
    for node_name, node in expected.items():
        assert list(got[node_name].input) == list(node.input) and list(got[node_name].output) == list(node.output)
        assert _attrs(got[node_name]) == _attrs(node) and got[node_name].domain == node.domain
        for tensor in node.input[1:]:
            np.testing.assert_array_equal(mine[tensor], lib[tensor])
            assert mine[tensor].dtype == lib[tensor].dtype
    fp32 = _arrays(onnx.load(str(fp32_dir / f"{name}.onnx")))
    copied = [tensor for tensor in mine if tensor in fp32]  # what is not quantized is copied through
    assert copied or name == "vocab"
    for tensor in copied:
        np.testing.assert_array_equal(mine[tensor], fp32[tensor])
    assert {o.domain: o.version for o in ours.opset_import} == {o.domain: o.version for o in theirs.opset_import}


def _assert_embedding(ours_dir: Path, fp32_dir: Path, bits: int, group: int) -> None:
    """GatherBlockQuantized reads the library routine's blocks of the whole table (the LM head's when tied)."""
    graph = onnx.load(str(ours_dir / "vocab.onnx")).graph
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    arrays = _arrays(onnx.load(str(ours_dir / "vocab.onnx")))
    table = next(t for t in onnx.load(str(fp32_dir / "vocab.onnx")).graph.initializer if "embed" in t.name)
    config = DefaultWeightOnlyQuantConfig(block_size=group, is_symmetric=True, bits=bits)
    packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
        np.ascontiguousarray(numpy_helper.to_array(table).T))
    np.testing.assert_array_equal(arrays[gather.input[0]], packed)
    lifted = next((n for n in graph.node if n.output[0] == gather.input[2]), None)  # absent: an alias, [V, blocks, 1]
    np.testing.assert_array_equal(arrays[lifted.input[0]] if lifted else arrays[gather.input[2]][..., 0], scales)


def _assert_tensorrt_blocks(ours_dir: Path, name: str, bits: int, group: int) -> None:
    """Each DequantizeLinear rebuilds its MatMulNBits weight: exactly where the scale was positive, within one
    step where TensorRT needed the block negated."""
    ort = _arrays(onnx.load(str(ours_dir / f"{name}.onnx")))
    trt_graph = onnx.load(str(ours_dir / "tensorrt" / f"{name}.onnx")).graph
    trt = _arrays(onnx.load(str(ours_dir / "tensorrt" / f"{name}.onnx")))
    checked = 0
    for node in trt_graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        weight = node.input[0].removesuffix(f"_q{bits}")
        axis = _attrs(node)["axis"]
        packed = ort.get(f"{weight}_Q{bits}", ort.get(f"{weight}.T_Q{bits}"))
        scales = ort.get(f"{weight}_scales", ort.get(f"{weight}.T_scales"))
        values = trt[node.input[0]].astype(np.float32)
        q = packed.reshape(packed.shape[0], -1)
        if bits == 4:
            q = np.stack([q & 15, q >> 4], -1).reshape(q.shape[0], -1)
        ort_weight = (q.astype(np.float32) - (1 << (bits - 1))) * np.repeat(scales, group, 1)  # [N, K]
        trt_weight = values * np.repeat(trt[node.input[1]], group, axis)
        if axis == 0:
            trt_weight = trt_weight.T
        step = np.repeat(np.abs(scales), group, 1)
        assert np.all(np.abs(trt_weight - ort_weight) <= step * 1.0001)
        np.testing.assert_array_equal(trt_weight[np.repeat(scales, group, 1) > 0],
                                      ort_weight[np.repeat(scales, group, 1) > 0])
        checked += 1
    assert checked


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("tied", [True, False])
def test_per_tensor_graphs_with_data_files_equal_the_library_quantizer(tmp_path, tied, scheme):
    fp32, out = tmp_path / "fp32", tmp_path / "out"
    fp32.mkdir()
    _small_graphs(fp32, tied)
    shutil.copytree(fp32, out)
    s = check_scheme(scheme, 32, H, "fp32")
    lines: list[str] = []
    records = {name: quantize_graph(out, name, s, lines.append, slice_bytes=7 * H * 4) for name in ("target", "vocab")}
    for name in ("target", "vocab"):  # rows of the vocabulary matrices went 7 at a time: 8 chunks, the last short
        _assert_as_the_library(out, fp32, name, s.bits, 32, s.accuracy_level)
        _assert_tensorrt_blocks(out, name, s.bits, 32)
        assert (out / f"{name}.onnx.data").is_file() and (out / "tensorrt" / f"{name}.onnx.data").is_file()
    _assert_embedding(out, fp32, s.bits, 32)
    assert records["vocab"]["tied"] is tied and records["vocab"]["MatMulNBits"] == 1
    assert records["target"]["tensorrt_fp32_weights"] == 1  # the weight two MatMuls read
    trt_target = onnx.load(str(out / "tensorrt" / "target.onnx"), load_external_data=False).graph
    assert "model.layers.1.q" in {t.name for t in trt_target.initializer}
    assert not (out / STAGING).exists() and sorted(p.name for p in out.iterdir()) == [
        "target.onnx", "target.onnx.data", "tensorrt", "vocab.onnx", "vocab.onnx.data"]
    assert any(line.startswith("quantized vocab.onnx") for line in lines)


@pytest.mark.parametrize("tied", [True, False])
def test_exported_graphs_equal_the_library_quantizer(tmp_path, tied):
    snap = make_snapshot(tmp_path / "snap", "qwen3", tied=tied)
    s = Snapshot(snap)
    head = save_head(init_head(head_config_for(s, 1, 6, pick_mask_token(s)), seed=3), tmp_path / "head")
    fp32 = export_artifacts(snap, head, tmp_path / "fp32", max_tree=16, max_context=64, progress=lambda _: None)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("target", "draft", "vocab"):
        shutil.copy2(fp32 / f"{name}.onnx", out / f"{name}.onnx")
    scheme = check_scheme("int4", 32, 64, "fp32")
    for name in ("target", "draft", "vocab"):
        quantize_graph(out, name, scheme, lambda _: None)
        _assert_as_the_library(out, fp32, name, 4, 32, scheme.accuracy_level)
        _assert_tensorrt_blocks(out, name, 4, 32)
    _assert_embedding(out, fp32, 4, 32)


PEAK_SCRIPT = """
import sys
from pathlib import Path
from glance_export.onnx.quantize import check_scheme, quantize_graphs
quantize_graphs(Path(sys.argv[1]), check_scheme(sys.argv[2], 128, 1024, "fp32"), progress=lambda _: None)
print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))
"""


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int4"])
def test_quantize_peak_is_flat_from_2_to_8_layers(tmp_path, scheme):
    """The quantize step of eight layers of a mid-size model holds no more than that of two: one tensor at a
    time is read, quantized and written (a whole-graph rewrite holds several copies of every layer). The
    estimate the export refuses by covers it and does not grow either."""
    peaks, weights, estimates = {}, {}, {}
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'runtime'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    for layers in (2, 8):
        snap, weights[layers] = make_mid_snapshot(tmp_path / f"s{layers}", layers)
        estimates[layers] = estimate_peak(Checkpoint(snap), 4, 0, layers, 2, 1 << 28, quantize=True).peak
        s = Snapshot(snap)
        head = save_head(init_head(head_config_for(s, 1, 6, pick_mask_token(s)), seed=0), tmp_path / f"h{layers}")
        fp32 = export_artifacts(snap, head, tmp_path / f"a{layers}", max_tree=16, max_context=64,
                                progress=lambda _: None)
        work = tmp_path / f"q{layers}"
        work.mkdir()
        for name in ("target", "draft", "vocab"):
            for path in fp32.glob(f"{name}.onnx*"):
                shutil.move(path, work / path.name)
        shutil.rmtree(fp32)
        done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(work), scheme], env=env, capture_output=True,
                              text=True, check=True)
        peaks[layers] = int(done.stdout.split()[-1]) * 1024
        assert (work / "tensorrt" / "target.onnx.data").is_file()
        shutil.rmtree(work)
    assert peaks[8] - peaks[2] < 0.1 * (weights[8] - weights[2]), (peaks, weights)
    assert estimates[8] - estimates[2] < 0.1 * (weights[8] - weights[2]), estimates
    assert all(peaks[n] <= estimates[n] for n in peaks), (peaks, estimates)


def test_quantized_refusal_names_the_shortfall_without_the_fp16_advice(tmp_path):
    """`--quantize` does not take `--dtype fp16`, so its refusal does not suggest it."""
    checkpoint = Checkpoint(make_snapshot(tmp_path / "snap", "qwen3"))
    quantized = estimate_peak(checkpoint, 4, 0, 4, 2, 1 << 28, quantize=True)
    assert quantized.peak >= estimate_peak(checkpoint, 4, 0, 4, 2, 1 << 28).peak
    with pytest.raises(GlanceError, match=r"GiB short\); close other programs") as err:
        check_fits(quantized, "fp32", available=quantized.peak - 2 * GIB, quantize=True)
    assert "--dtype fp16" not in str(err.value) and "\n" not in str(err.value)


def _int4_export(tmp_path: Path, tied: bool = False, lines: list[str] | None = None) -> tuple[Path, Path, Path]:
    """(snapshot, head, int4 artifacts) of a tiny qwen3 model, group 32."""
    snap = make_snapshot(tmp_path / "snap", "qwen3", tied=tied)
    s = Snapshot(snap)
    head = save_head(init_head(head_config_for(s, 1, 6, pick_mask_token(s)), seed=3), tmp_path / "head")
    out = export_artifacts(snap, head, tmp_path / "int4", max_tree=16, max_context=64, quantize="int4", group_size=32,
                           progress=(lines.append if lines is not None else lambda _: None))
    return snap, head, out


@pytest.mark.parametrize("cut", ["whole", "cut", "cut-borrowed"])
@pytest.mark.parametrize("tied", [True, False])
def test_an_int4_export_equals_the_library_quantizer_on_its_fp32_export(tmp_path, monkeypatch, tied, cut):
    """Written quantized straight from the trace (no fp32 graph), an int4 export holds what ONNX Runtime's
    whole-graph quantizer makes of the fp32 export, with the target validated whole or as its depth cut
    (its own quantized graph, or the full graph's blocks read from its data file)."""
    import glance_export.onnx.depth_cut as depth_cut
    import glance_export.onnx.export as export_mod

    if cut != "whole":
        monkeypatch.setattr(depth_cut, "FULL_VALIDATION_BYTES", 0)
    if cut == "cut-borrowed":
        monkeypatch.setattr(export_mod, "EXTERNAL_DATA_BYTES", 0)
    lines: list[str] = []
    snap, head, out = _int4_export(tmp_path, tied, lines)
    fp32 = export_artifacts(snap, head, tmp_path / "fp32", max_tree=16, max_context=64, progress=lambda _: None)
    for name in ("target", "draft", "vocab"):
        _assert_as_the_library(out, fp32, name, 4, 32, 4)
        _assert_tensorrt_blocks(out, name, 4, 32)
    _assert_embedding(out, fp32, 4, 32)
    assert [p.name for p in out.rglob(".*")] == [".glance-output.json"]  # no scratch left behind
    cut_lines = [line for line in lines if "2-layer cut of target.onnx (int4" in line]
    assert len(cut_lines) == (cut != "whole")
    assert ("read from target.onnx.data" in "".join(cut_lines)) is (cut == "cut-borrowed")
    assert sum("against torch holding the same int4 weights dequantized" in line for line in lines) == 3


def _quantized_graph(tmp_path: Path, snap: Path, head: Path, name: str):
    """The graph's torch wrapper, the weights behind it, its rewrite by the export, and validation feeds."""
    from glance_export.onnx.feeds import trace_feeds
    from glance_export.onnx.quant_export import export_quantized
    from glance_export.onnx.sources import build_graphs, open_sources, target_skeleton
    from glance_export.onnx.spec import dims_for, dynamic_axes, output_shapes
    from glance_export.onnx.validate import validation_feeds

    snapshot, checkpoint, draft = open_sources(snap, head, "fp32")
    skeleton = target_skeleton(snapshot, checkpoint, "fp32")
    dims = dims_for(snapshot, draft)
    module = build_graphs(skeleton, draft, dims, 8)[name]
    scheme = check_scheme("int4", 32, dims.hidden, "fp32")
    scratch = tmp_path / "again"
    scratch.mkdir()
    graph = export_quantized(module, trace_feeds(snapshot, dims, "float32")[name], scratch, name,
                             dynamic_axes(dims, name, module.input_names, module.output_names), 17,
                             output_shapes(dims, name, 8), skeleton, scheme, name == "vocab", lambda _: None)
    return module, skeleton, graph, scheme, validation_feeds(name, dims, snapshot, "fp32", 1)


def test_quantized_validation_refuses_blocks_that_are_not_the_snapshots(tmp_path):
    """A block of the written vocabulary matrix scaled by 3 (still finite, the graph still well formed) is refused
    by name: the dequantized weights torch computes with are checked against the snapshot's."""
    from glance_export.onnx.quant_validate import validate_quantized_graph

    snap, head, out = _int4_export(tmp_path)
    module, skeleton, graph, scheme, feeds = _quantized_graph(tmp_path, snap, head, "vocab")
    model = onnx.load(str(out / "vocab.onnx"))
    scales = next(t for t in model.graph.initializer if t.name.endswith("_scales"))
    values = numpy_helper.to_array(scales).copy()
    values[3, 0] *= 3
    scales.CopyFrom(numpy_helper.from_array(values, scales.name))
    onnx.save_model(model, str(out / "vocab.onnx"))
    graph.forms.ort_model.CopyFrom(model)  # the blocks as now written
    with pytest.raises(GlanceError, match=r"vocab graph: quantized weight \S+ is more than one step from the source"):
        validate_quantized_graph("vocab", out / "vocab.onnx", module, graph, feeds, skeleton.materialized, scheme)


def test_quantized_validation_refuses_a_miswired_graph(tmp_path):
    """Two layers' up projections swapped in the written target (every block still the snapshot's, so only the
    comparison with torch can tell) fail validation in one line."""
    from glance_export.onnx.quant_validate import validate_quantized_graph

    snap, head, out = _int4_export(tmp_path)
    module, skeleton, graph, scheme, feeds = _quantized_graph(tmp_path, snap, head, "target")
    validate_quantized_graph("target", out / "target.onnx", module, graph, feeds, skeleton.materialized, scheme)
    model = onnx.load(str(out / "target.onnx"))
    ups = [n for n in model.graph.node if n.op_type == "MatMulNBits" and "up_proj" in n.input[1]]
    (ups[0].input[1], ups[1].input[1]), (ups[0].input[2], ups[1].input[2]) = \
        (ups[1].input[1], ups[0].input[1]), (ups[1].input[2], ups[0].input[2])
    onnx.save_model(model, str(out / "target.onnx"))
    with pytest.raises(GlanceError, match=r"^target graph: output \S+ max error \S+ exceeds"):
        validate_quantized_graph("target", out / "target.onnx", module, graph, feeds, skeleton.materialized, scheme)


def _written_bytes() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/io") if line.startswith("wchar"))


def test_an_int4_export_writes_no_fp32_graph(tmp_path):
    """Each weight goes from the snapshot to its blocks: the export writes about a quarter of the fp32 weights'
    bytes (two int4 forms and their scales), not the fp32 graphs that it would read back and delete."""
    snap, weights = make_mid_snapshot(tmp_path / "snap", 2)
    s = Snapshot(snap)
    head = save_head(init_head(head_config_for(s, 1, 6, pick_mask_token(s)), seed=0), tmp_path / "head")
    before = _written_bytes()
    export_artifacts(snap, head, tmp_path / "int4", max_tree=16, max_context=64, quantize="int4",
                     progress=lambda _: None)
    written = _written_bytes() - before
    assert written < 0.5 * weights, (written, weights)


def _kill_at(argv: list[str], marker: str) -> str:
    """Run glance-export in a process of its own and SIGKILL it as soon as it prints `marker`; its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from glance_export.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            proc.kill()
            break
    seen.append(proc.communicate(timeout=300)[0])
    assert marker in "".join(seen) and proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


@pytest.mark.slow
def test_a_killed_int4_export_leaves_the_previous_one(tmp_path):
    """Killed while writing its quantized forms or validating them (the scratch cut and exact-graph copies live in
    the export's temporary directory), an int4 export leaves the previous export byte for byte."""
    snap, head, out = _int4_export(tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    argv = ["onnx", "--model", snap, "--head", head, "--out", out, "--max-tree", "16", "--max-context", "64",
            "--quantize", "int4", "--group-size", "32"]
    for marker in ("exported target.onnx", "exported vocab.onnx", "validated target.onnx", "validated draft.onnx"):
        _kill_at(argv, marker)
        assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
