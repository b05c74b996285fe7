"""Weight-only int8/int4 artifacts: GLANCE identical to the quantized target's own greedy decode on every
family (plain, partly and fully right drafts); the weights really changed and none is stored twice (a tied
matrix is one packed tensor read by MatMulNBits and GatherBlockQuantized); the manifest records the
scheme and hashes the TensorRT form, which TensorRT-RTX builds and the device profiles gate; drift from
the fp32 export is reported per prompt."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from glance_export.model.adapters import Snapshot
from glance_export.cli import main as export_main
from glance_export.build.targets import load_profile
from glance_export.audit.drift import compare, drift
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_export.onnx.external_data import graph_tensors
from glance_export.onnx.quantize import check_scheme
from glance_export.build.quant_engines import engine_manifest
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.errors import GlanceError
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.formats.artifacts import read as load_manifest
from glance_runtime.prompt.codec import exported_codec
from support import ALL_FAMILIES, TENSORRT_RTX_MISSING, make_snapshot

GROUP = 32  # divides the tiny models' hidden size (64)
PROMPTS = ["Describe the image.", "What colour is the square? The quick brown fox"]
_EXPORTS: dict[tuple, Path] = {}


def _export(root_factory, family: str, scheme: str | None, tied: bool = False,
            accuracy: str = "int8") -> tuple[Path, Path]:
    """(snapshot, artifacts) per (family, scheme, tied, accuracy), once per session; the same head for every
    scheme."""
    key = (family, scheme, tied, accuracy)
    if key not in _EXPORTS:
        base = _EXPORTS.get((family, "root", tied))
        if base is None:
            base = root_factory.mktemp(f"quant_{family}_{tied}")
            snap = Snapshot(make_snapshot(base / "snapshot", family, tied=tied))
            save_head(init_head(head_config_for(snap, 1, 6, pick_mask_token(snap)), seed=3), base / "head")
            _EXPORTS[family, "root", tied] = base
        _EXPORTS[key] = export_artifacts(base / "snapshot", base / "head", base / f"{scheme or 'fp32'}-{accuracy}",
                                         max_tree=16, max_context=128, quantize=scheme, group_size=GROUP,
                                         accuracy=accuracy, progress=lambda _: None)
    return _EXPORTS[family, "root", tied] / "snapshot", _EXPORTS[key]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return lambda family, scheme="int4", tied=False, accuracy="int8": _export(tmp_path_factory, family, scheme, tied,
                                                                             accuracy)


def _tensors(path: Path) -> list[onnx.TensorProto]:
    return list(graph_tensors(onnx.load(str(path)).graph))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("family", [f if f in ("qwen2_5_vl", "qwen3") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in ALL_FAMILIES])
def test_glance_is_identical_to_the_quantized_greedy(export, family, scheme):
    _, artifacts = export(family, scheme)
    backend = OrtBackend(artifacts)
    codec = exported_codec(backend.manifest)
    stops = codec.stop_ids
    for text in PROMPTS:
        prompt = codec.turn(text)
        truth = decode(backend, prompt, DecodeConfig(max_new_tokens=12, speculative=False), stops).tokens
        cfg = DecodeConfig(max_new_tokens=12, budget=15, branch_k=4)
        assert decode(backend, prompt, cfg, stops).tokens == truth
        for depth in (2, 5):  # partly and fully right drafts: acceptance and the KV gather are exercised
            seeded = SeededDrafter(backend, truth, prompt.length, lambda d, depth=depth: 0 if d <= depth else None)
            result = decode(seeded, prompt, cfg, stops)
            assert result.tokens == truth
            assert result.tau > 1.5


def test_audit_cli_passes_on_quantized_artifacts(export, tmp_path, capsys):
    _, artifacts = export("qwen2_5_vl", "int8")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    code = export_main(["audit", "--backend", "onnxruntime", "--artifacts", str(artifacts), "--data", str(tasks),
                        "--budget", "15", "--max-new-tokens", "10"])
    assert code == 0 and "2/2 identical to greedy" in capsys.readouterr().out


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_weights_changed_and_are_stored_once(export, tied):
    snap, artifacts = export("qwen2_5_vl", "int4", tied)
    _, fp32 = export("qwen2_5_vl", None, tied)
    tc = Snapshot(snap).text_config
    vocab, hidden = tc["vocab_size"], tc["hidden_size"]
    manifest = json.loads((artifacts / "manifest.json").read_text())
    for form in ("file", "tensorrt_file"):
        seen = set()
        for name in ("target", "draft", "vocab"):
            entry = manifest["quantization"]["graphs"][name]
            for t in _tensors(artifacts / entry[form]):
                a = numpy_helper.to_array(t) if t.data_type != onnx.TensorProto.INT4 else np.frombuffer(t.raw_data, np.uint8)
                if a.nbytes >= 2048:
                    key = hashlib.sha256(np.sort(a.ravel()).tobytes()).hexdigest()
                    assert key not in seen, f"a {list(t.dims)} tensor of {entry[form]} is stored twice"
                    seen.add(key)
    vocab_tensors = _tensors(artifacts / "vocab.onnx")
    assert not [t for t in vocab_tensors if t.data_type == onnx.TensorProto.FLOAT and list(t.dims) == [vocab, hidden]], \
        "an fp32 vocabulary matrix is left"
    packed = [t for t in vocab_tensors if t.data_type == onnx.TensorProto.UINT8 and list(t.dims) == [vocab, hidden // GROUP, GROUP // 2]]
    assert len(packed) == (1 if tied else 2)
    graph = onnx.load(str(artifacts / "vocab.onnx")).graph
    readers = sorted(sorted({n.op_type for n in graph.node if t.name in n.input}) for t in packed)
    assert readers == ([["GatherBlockQuantized", "MatMulNBits"]] if tied else [["GatherBlockQuantized"], ["MatMulNBits"]])
    target = onnx.load(str(artifacts / "target.onnx")).graph
    assert not [n for n in target.node if n.op_type == "MatMul" and n.input[1] in {t.name for t in target.initializer}]
    assert sum(n.op_type == "MatMulNBits" for n in target.node) == 7 * Snapshot(snap).text_config["num_hidden_layers"]
    feed = {"ids": np.array([1, 5, 9], np.int64), "hidden": np.random.default_rng(0).normal(size=(2, hidden)).astype(np.float32)}
    ours = ort.InferenceSession(str(artifacts / "vocab.onnx")).run(["embeds"], feed)[0]
    theirs = ort.InferenceSession(str(fp32 / "vocab.onnx")).run(["embeds"], feed)[0]
    assert 0 < np.abs(ours - theirs).max() < 0.2 * np.abs(theirs).max()


def test_tensorrt_form_computes_what_the_onnxruntime_form_does(export):
    _, artifacts = export("qwen2_5_vl", "int8", True)
    feed = {"ids": np.array([1, 5, 9], np.int64), "hidden": np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)}
    ours = ort.InferenceSession(str(artifacts / "vocab.onnx")).run(None, feed)
    trt = ort.InferenceSession(str(artifacts / "tensorrt" / "vocab.onnx")).run(None, feed)
    np.testing.assert_allclose(trt[0], ours[0], atol=0.05)  # blocks whose scale TensorRT needs flipped differ by a step
    graph = onnx.load(str(artifacts / "tensorrt" / "vocab.onnx")).graph
    assert {n.op_type for n in graph.node} >= {"DequantizeLinear", "Gather", "Gemm"}
    assert not any(n.domain == "com.microsoft" for n in graph.node)


def test_manifest_records_the_scheme_and_hashes_both_forms(export):
    _, artifacts = export("qwen3", "int4")
    manifest = json.loads((artifacts / "manifest.json").read_text())
    q = manifest["quantization"]
    assert (q["scheme"], q["bits"], q["group_size"], q["library_version"]) == ("int4", 4, GROUP, ort.__version__)
    assert q["graphs"]["vocab"]["GatherBlockQuantized"] == 2 and "vision" not in q["graphs"]
    for entry in q["graphs"].values():
        assert entry["tensorrt_file"] in manifest["file_hashes"]
    load_manifest(artifacts)  # the runtime's integrity check passes
    data = (artifacts / q["graphs"]["draft"]["tensorrt_file"]).read_bytes()
    assert manifest["file_hashes"][q["graphs"]["draft"]["tensorrt_file"]]["size"] == len(data)


def _accuracy_levels(path: Path) -> set[int | None]:
    """The accuracy_level of every MatMulNBits in a graph (None: the attribute is absent, i.e. 0)."""
    nodes = [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]
    return {next((a.i for a in n.attribute if a.name == "accuracy_level"), None) for n in nodes}


def test_int8_activations_are_the_default_and_exact_keeps_fp32(export, capsys):
    """The default multiplies with int8 activations (the fast path for several rows) and says so in the
    manifest; --accuracy exact keeps fp32 activations; an fp32 export has no quantization to speak of."""
    _, fast = export("qwen2_5_vl", "int4")
    _, exact = export("qwen2_5_vl", "int4", accuracy="exact")
    _, fp32 = export("qwen2_5_vl", None)
    for name in ("target", "draft", "vocab"):
        assert _accuracy_levels(fast / f"{name}.onnx") == {4}
        assert _accuracy_levels(exact / f"{name}.onnx") == {None}
    assert json.loads((fast / "manifest.json").read_text())["quantization"]["accuracy_level"] == 4
    assert json.loads((exact / "manifest.json").read_text())["quantization"]["accuracy_level"] == 0
    assert load_manifest(fast).quantization.int8_activations and not load_manifest(exact).quantization.int8_activations
    assert load_manifest(fp32).quantization is None
    assert export_main(["onnx", "--model", "m", "--head", "h", "--out", "o", "--accuracy", "exact"]) == 2
    assert "--accuracy applies to quantized graphs only" in capsys.readouterr().err


def test_refusals_are_one_line():
    with pytest.raises(GlanceError, match="unknown --accuracy"):
        check_scheme("int4", 32, 64, "fp32", "fp16")
    with pytest.raises(GlanceError, match="does not divide the hidden size 64"):
        check_scheme("int4", 128, 64, "fp32")
    with pytest.raises(GlanceError, match="--dtype fp32"):
        check_scheme("int8", 32, 64, "fp16")
    with pytest.raises(GlanceError, match="unknown --quantize"):
        check_scheme("int2", 32, 64, "fp32")


def test_build_refuses_a_scheme_the_target_cannot_run(export, tmp_path, capsys):
    _, artifacts = export("qwen3", "int4")
    manifest = load_manifest(artifacts)
    with pytest.raises(GlanceError, match="jetson-orin does not run int4 weights"):
        engine_manifest(load_profile("jetson-orin"), manifest)
    built = engine_manifest(load_profile("rtx"), manifest)
    assert built.graphs["target"].file == "tensorrt/target.onnx" and built.opset == 21
    assert engine_manifest(load_profile("jetson-orin"), replace(manifest, quantization=None)).opset == manifest.opset
    code = export_main(["build", "--target", "jetson-orin", "--artifacts", str(artifacts), "--out",
                        str(tmp_path / "bundle"), "--plan-only"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "does not run int4 weights" in err


def test_rtx_builds_quantized_engines(export, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    _, artifacts = export("qwen3", "int4")
    assert export_main(["build", "--target", "rtx", "--artifacts", str(artifacts), "--out", str(tmp_path / "e")]) == 0
    record = json.loads((tmp_path / "e" / "engines.json").read_text())
    assert record["engines"]["target"]["onnx"][0]["file"] == "target.onnx"
    assert set(record["engines"]) == {"target", "draft", "vocab"}


def test_drift_reports_per_prompt_against_fp32(export, tmp_path):
    _, quantized = export("qwen2_5_vl", "int4")
    _, fp32 = export("qwen2_5_vl", None)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    report = drift(quantized, fp32, tasks, 10)
    assert report["n"] == 2 and report["scheme"] == "int4" and len(report["prompts"]) == 2
    assert all(r["reference_tokens"] == 10 or r["reference_tokens"] < 10 for r in report["prompts"])
    assert drift(fp32, fp32, tasks, 10)["identical"] == 2
    with pytest.raises(GlanceError, match="itself quantized"):
        drift(fp32, quantized, tasks, 10)
    _, other = export("qwen3", "int4")
    with pytest.raises(GlanceError, match="different targets"):
        drift(other, fp32, tasks, 10)


def test_compare_counts_the_shared_prefix():
    assert compare([1, 2, 3], [1, 2, 3]) == {"identical": True, "first_divergence": None, "tokens": 3,
                                             "reference_tokens": 3, "prefix_tokens": 3, "position_agreement": 1.0}
    row = compare([1, 9, 3, 4], [1, 2, 3])
    assert (row["first_divergence"], row["prefix_tokens"], row["position_agreement"]) == (1, 1, 0.5)
