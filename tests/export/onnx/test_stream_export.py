"""The streamed export: real snapshot layouts (bf16 shards with an index), the depth-cut validation, the
memory refusal, and a resident peak that does not grow with the model's depth."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

import glance_export.onnx.depth_cut as depth_cut
from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_export.onnx.checkpoint import INDEX, Checkpoint
from glance_export.onnx.external_data import graph_tensors
from glance_export.onnx.memory import GIB, check_fits, estimate_peak
from glance_runtime.errors import GlanceError
from support import make_mid_snapshot, make_snapshot

ROOT = Path(__file__).resolve().parents[3]


def _bf16_snapshot(src: Path, out: Path, shards: int) -> Path:
    """The same snapshot with its weights rounded to bf16: `shards` > 1 as bf16 shards with an index, else
    as one fp32 file of the rounded values (the same numbers, another layout)."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    if shards == 1:
        save_file({k: v.float() for k, v in tensors.items()}, str(out / "model.safetensors"))
        return out
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(out / name))
        weight_map.update({k: name for k in part})
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _head(snap: Path, root: Path) -> Path:
    s = Snapshot(snap)
    return save_head(init_head(head_config_for(s, 1, 6, pick_mask_token(s)), seed=0), root / "head")


def _weights(artifacts: Path) -> dict[str, list[bytes]]:
    manifest = json.loads((artifacts / "manifest.json").read_text())
    return {g: sorted(numpy_helper.to_array(t).tobytes() for t in graph_tensors(onnx.load(str(artifacts / e["file"])).graph))
            for g, e in manifest["graphs"].items()}


@pytest.mark.parametrize("family,tied", [("qwen2_5_vl", True), ("qwen3", False)])
def test_sharded_bf16_snapshot_exports_like_one_fp32_file(tmp_path, family, tied):
    """bf16 shards named by an index, upcast per tensor, give the graphs of the same values in one fp32 file."""
    src = make_snapshot(tmp_path / "src", family, tied=tied)
    sharded = _bf16_snapshot(src, tmp_path / "sharded", shards=3)
    single = _bf16_snapshot(src, tmp_path / "single", shards=1)
    assert len(Checkpoint(sharded).entries) == len(Checkpoint(single).entries)
    head = _head(single, tmp_path)
    a = export_artifacts(sharded, head, tmp_path / "a", max_tree=16, max_context=64, progress=lambda _: None)
    b = export_artifacts(single, head, tmp_path / "b", max_tree=16, max_context=64, progress=lambda _: None)
    assert _weights(a) == _weights(b)
    source = json.loads((a / "manifest.json").read_text())["source"]["weights_sha256"]
    assert sorted(source) == sorted(p.name for p in sharded.glob("*.safetensors"))


def test_missing_shard_is_one_line_error(tmp_path):
    src = make_snapshot(tmp_path / "src", "qwen3")
    sharded = _bf16_snapshot(src, tmp_path / "sharded", shards=2)
    head = _head(sharded, tmp_path)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(GlanceError, match="lacks model-00002-of-00002.safetensors"):
        export_artifacts(sharded, head, tmp_path / "out", max_tree=16, max_context=64, progress=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_depth_cut_validation_exports_the_same_graphs(snapshot_dir, tmp_path, monkeypatch):
    """A target too large to validate whole is checked as a 2-layer cut plus a full-depth smoke run; the
    graphs written are the ones a whole validation passes."""
    snap = snapshot_dir("qwen3_vl")
    head = _head(snap, tmp_path)
    whole = export_artifacts(snap, head, tmp_path / "whole", max_tree=16, max_context=64, progress=lambda _: None)
    monkeypatch.setattr(depth_cut, "FULL_VALIDATION_BYTES", 0)
    lines: list[str] = []
    cut = export_artifacts(snap, head, tmp_path / "cut", max_tree=16, max_context=64, progress=lines.append)
    assert any("all 4 layers" in line for line in lines) and any("2-layer cut" in line for line in lines)
    assert _weights(cut) == _weights(whole)


def test_smoke_run_fails_on_a_corrupt_graph(snapshot_dir, tmp_path):
    """The full-depth smoke run is a real check: a graph whose weights turned to NaN fails it in one line."""
    snap = snapshot_dir("qwen3")
    head = _head(snap, tmp_path)
    out = export_artifacts(snap, head, tmp_path / "art", max_tree=16, max_context=64, progress=lambda _: None)
    model = onnx.load(str(out / "target.onnx"))
    weight = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    weight.CopyFrom(numpy_helper.from_array(np.full_like(numpy_helper.to_array(weight), np.nan), weight.name))
    onnx.save_model(model, str(tmp_path / "target.onnx"))
    from glance_export.onnx.spec import dims_for
    from glance_export.model.head import load_head

    dims = dims_for(Snapshot(snap), load_head(head))
    with pytest.raises(GlanceError, match="smoke run of target.onnx: output .* is not finite"):
        depth_cut.smoke_run(tmp_path / "target.onnx", dims, "fp32", 1)


def test_refusal_names_the_shortfall_and_the_fix(snapshot_dir):
    estimate = estimate_peak(Checkpoint(snapshot_dir("qwen2")), 4, 0, 4, 2, 1 << 28)
    with pytest.raises(GlanceError, match=r"GiB short\); export with --dtype fp16") as err:
        check_fits(estimate, "fp32", available=estimate.peak - 2 * GIB)
    assert "\n" not in str(err.value)
    check_fits(estimate, "fp32", available=estimate.peak)


PEAK_SCRIPT = """
import sys
import threading
import time
from glance_export.onnx import export_artifacts

def anon_kib():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon'))

peak, done = [anon_kib()], threading.Event()
def watch():
    while not done.is_set():
        peak.append(max(peak.pop(), anon_kib()))
        time.sleep(0.002)
watcher = threading.Thread(target=watch)
watcher.start()
export_artifacts(sys.argv[1], sys.argv[2], sys.argv[3], max_tree=16, max_context=64, progress=lambda _: None,
                 quantize=sys.argv[4] if len(sys.argv) > 4 else None)
done.set()
watcher.join()
print(max(peak[0], anon_kib()))
"""


def _export_peak_kib(snap: Path, head: Path, out: Path, quantize: str | None = None) -> int:
    """The export's peak anonymous memory, sampled: pages of the memory-mapped snapshot and graphs are
    page cache the kernel can drop, and how many stay resident depends on the machine, not the exporter."""
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'runtime'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "MALLOC_ARENA_MAX": "1"}
    args = [str(snap), str(head), str(out), *([quantize] if quantize else [])]
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, *args], env=env, capture_output=True, text=True,
                          check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_export_peak_is_flat_from_2_to_12_layers(tmp_path, quantize):
    """Twelve layers of a mid-size model (about 60 MB each in fp32) cost the exporter no more memory than
    two: the weights stream through, validation holds a 2-layer cut, and the full-depth smoke run's
    sessions, one segment of the cut's size at a time, leave nothing behind in the heap (the peaks differ
    by about 15 MB; with glibc's mmap threshold left to rise they differed by two layers). Holding one
    more layer's weights fails. An int4 export likewise: each weight goes straight to its blocks, and its
    validation holds the cut with its weights multiplied back out of the full graph's blocks."""
    peaks, weights = {}, {}
    for layers in (2, 12):
        snap, weights[layers] = make_mid_snapshot(tmp_path / f"s{layers}", layers)
        head = _head(snap, tmp_path / f"h{layers}")
        peaks[layers] = _export_peak_kib(snap, head, tmp_path / f"a{layers}", quantize) * 1024
        for done in (snap, head.parent, tmp_path / f"a{layers}"):  # one depth on disk at a time
            shutil.rmtree(done)
    growth = peaks[12] - peaks[2]
    assert growth < 0.1 * (weights[12] - weights[2]), (peaks, weights)


def test_progress_names_the_layer_and_an_eta_from_the_write_rate():
    from glance_export.onnx.stream import QUIET_BYTES, eta_reporter

    lines: list[str] = []
    report = eta_reporter("target.onnx", 4, lines.append, every_s=0)
    for i in range(4):
        time.sleep(0.01)
        report((i + 1) * QUIET_BYTES, 4 * QUIET_BYTES, f"lm.layers.{i}.mlp.up_proj.weight")
    assert "layer 1/4" in lines[0] and "left" not in lines[0]  # one tensor written: no rate yet
    assert "layer 2/4" in lines[1] and re.search(r"about \d+s left$", lines[1])
    assert "layer 4/4" in lines[-1] and "left" not in lines[-1]
    quiet: list[str] = []
    eta_reporter("draft.onnx", 0, quiet.append, every_s=0)(QUIET_BYTES - 1, QUIET_BYTES - 1, "fc.weight")
    assert quiet == []


def test_depth_cut_checks_the_full_graphs_own_bytes(snapshot_dir, tmp_path, monkeypatch):
    """The cut reads its weights from the full target's data file: a layer-0 weight zeroed there (finite,
    so the smoke run cannot see it) fails the cut's comparison with torch."""
    import glance_export.onnx.export as export_mod
    from glance_export.onnx.sources import build_graphs, open_sources, target_skeleton
    from glance_export.onnx.spec import dims_for
    from onnx.external_data_helper import ExternalDataInfo

    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_BYTES", 0)
    monkeypatch.setattr(depth_cut, "FULL_VALIDATION_BYTES", 0)
    snap = snapshot_dir("qwen3")
    head = _head(snap, tmp_path)
    lines: list[str] = []
    art = export_artifacts(snap, head, tmp_path / "art", max_tree=16, max_context=64, progress=lines.append)
    assert any("read from target.onnx.data" in line for line in lines)
    assert sorted(p.name for p in art.iterdir() if "target" in p.name) == ["target.onnx", "target.onnx.data"]
    model = onnx.load(str(art / "target.onnx"), load_external_data=False)
    weight = next(t for t in model.graph.initializer if "layers.0.mlp.down_proj" in t.name)
    info = ExternalDataInfo(weight)
    with open(art / "target.onnx.data", "r+b") as f:
        f.seek(info.offset)
        f.write(b"\0" * info.length)
    snapshot, checkpoint, draft = open_sources(snap, head, "fp32")  # the manifest's hashes would refuse first
    skeleton = target_skeleton(snapshot, checkpoint, "fp32")
    dims = dims_for(snapshot, draft)
    target = build_graphs(skeleton, draft, dims, 8)["target"]
    with pytest.raises(GlanceError, match="target graph: output .* max error"):
        depth_cut.validate_target(art, target, skeleton, dims, snapshot, "fp32", 17, "eager", 8, 1, lambda _: None)


def test_a_graph_run_in_segments_gives_what_it_gives_whole(tmp_path):
    """Segments of a graph with external weights, an If whose branches read an outer weight, and a value
    read two segments later compute exactly what one session over the whole graph computes."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from glance_export.onnx.node_runs import split
    from glance_export.onnx.segments import run_in_segments

    rng = np.random.default_rng(0)
    w = {f"w{i}": rng.standard_normal((64, 64) if i < 3 else (64,)).astype(np.float32) for i in range(4)}
    branch = lambda op: helper.make_graph([helper.make_node(op, ["h2", "w3"], ["b"])], op.lower(), [],
                                          [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"]), helper.make_node("Relu", ["h0"], ["r0"]),
             helper.make_node("MatMul", ["r0", "w1"], ["h1"]), helper.make_node("MatMul", ["h1", "w2"], ["h2"]),
             helper.make_node("If", ["flag"], ["h3"], then_branch=branch("Add"), else_branch=branch("Sub")),
             helper.make_node("Add", ["h3", "r0"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])],
                              [numpy_helper.from_array(v, k) for k, v in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(tmp_path / "g.onnx"), save_as_external_data=True, location="g.onnx.data",
                    size_threshold=0)
    assert len(split(onnx.load(str(tmp_path / "g.onnx"), load_external_data=False).graph, 64 * 64 * 4)) == 4
    feeds = [{"x": rng.standard_normal((n, 64)).astype(np.float32), "flag": np.array(n % 2 == 0)} for n in (3, 5)]
    whole = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    for feed, got in zip(feeds, run_in_segments(tmp_path / "g.onnx", feeds, budget=64 * 64 * 4)):
        assert np.array_equal(got["y"], whole.run(["y"], feed)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "g.onnx.data"]  # no segment file left


def test_a_qwen3_vl_cut_below_its_deepstack_taps_is_refused_before_work(tmp_path):
    """Qwen3-VL adds each deepstack feature to one of the first text layers; a cut shallower than its taps
    would write a manifest that no runtime can read, so the export refuses it first."""
    import transformers as tf

    snap = make_snapshot(tmp_path / "s", "qwen3_vl", layers=2)
    raw = json.loads((snap / "config.json").read_text())
    raw["vision_config"]["deepstack_visual_indexes"] = [0, 1, 1]
    (snap / "config.json").write_text(json.dumps(raw))
    tf.AutoModelForImageTextToText.from_config(tf.AutoConfig.from_pretrained(snap)).save_pretrained(snap)
    with pytest.raises(GlanceError, match=r"has 2 text layers but Qwen3-VL adds its 3 deepstack features .*keep at "
                                          r"least 3 text layers$"):
        export_artifacts(snap, _head(snap, tmp_path), tmp_path / "art", max_tree=16, max_context=64,
                         progress=lambda _: None)
    assert not (tmp_path / "art").exists()


def test_materialized_reads_only_the_named_weights(tmp_path):
    """Validation reads in only what a graph holds: a depth cut's module also holds the embedding (1.2 GB in fp32
    at 3B width), which its graph never reads."""
    from glance_export.onnx.sources import target_skeleton

    snap = make_snapshot(tmp_path / "snap", "qwen3")
    skeleton = target_skeleton(Snapshot(snap), Checkpoint(snap), "fp32", layers=2)
    model = skeleton.model
    with skeleton.materialized(model, {"model.norm.weight", "model.layers.1.mlp.up_proj.weight"}):
        assert not model.model.norm.weight.is_meta and not model.model.layers[1].mlp.up_proj.weight.is_meta
        assert model.model.embed_tokens.weight.is_meta and model.model.layers[0].mlp.up_proj.weight.is_meta
    with skeleton.materialized(model):
        assert not any(p.is_meta for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
