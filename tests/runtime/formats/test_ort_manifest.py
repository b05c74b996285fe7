"""manifest.json loading: a real export loads; stale, foreign, edited, malformed or incomplete ones fail in
one line with the fix, and no field the runtime reads can change without the manifest being refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_runtime.errors import GlanceError
from glance_runtime.formats import artifacts as fmt
from glance_runtime.formats.artifacts import check_source, check_version, read as load_manifest


@pytest.fixture(scope="module")
def exported(snapshot_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("manifest")
    snap = Snapshot(snapshot_dir("qwen2_vl"))
    head_dir = save_head(init_head(head_config_for(snap, 1, 4, pick_mask_token(snap)), seed=0), root / "head")
    return export_artifacts(snap.path, head_dir, root / "art", max_tree=16, max_context=128,
                            progress=lambda _: None), snap.path


@pytest.fixture
def artifacts(exported, tmp_path) -> Path:
    return Path(shutil.copytree(exported[0], tmp_path / "art"))


def _raw(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _edit(path: Path, change) -> None:
    """An edit by hand: the content hash is left as it was."""
    raw = _raw(path)
    change(raw)
    (path / "manifest.json").write_text(json.dumps(raw))


def _rewrite(path: Path, change) -> None:
    """A manifest written with a matching content hash, as a buggy or foreign writer would."""
    raw = _raw(path)
    change(raw)
    fmt.write(path, raw)


def _fails(path: Path, match: str) -> str:
    with pytest.raises(GlanceError, match=match) as err:
        load_manifest(path)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_real_export_loads(exported):
    m = load_manifest(exported[0])
    assert m.family == "qwen2_vl" and m.is_vl and m.float_dtype == "float32"
    assert (m.target.num_layers, m.target.kv_heads, m.target.head_dim) == (4, 2, 16)
    assert m.block_size == 4 and m.branch_k == 8 and m.max_tree == 16 and m.max_context == 128
    assert m.spatial_merge_size == 2 and m.vision_index_params["family"] == "qwen2_vl"
    assert _raw(exported[0])["format_version"] == fmt.VERSION
    check_source(m, exported[1])


def test_rewriting_a_manifest_unchanged_keeps_it_loadable(artifacts):
    _rewrite(artifacts, lambda raw: None)
    assert load_manifest(artifacts).branch_k == 8


def test_missing_pieces(artifacts, tmp_path):
    _fails(tmp_path / "nowhere", "does not exist")
    (tmp_path / "a-file").write_text("x")
    _fails(tmp_path / "a-file", "is not a directory")
    (artifacts / "vision.onnx").unlink()
    assert "glance-export onnx" in _fails(artifacts, "lacks the vision graph")
    (artifacts / "tokenizer.json").unlink()
    (artifacts / "manifest.json").unlink()
    _fails(artifacts, "no manifest.json")


def test_missing_listed_file(artifacts):
    (artifacts / "tokenizer.json").unlink()
    _fails(artifacts, "lacks tokenizer.json")


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "holds a JSON array, not an object"),
    ('"glance-onnx"', "holds a JSON string"),
    ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ('{"format": "glance-onnx", "format_version": NaN}', "NaN is not a JSON number"),
])
def test_not_an_object(artifacts, text, match):
    (artifacts / "manifest.json").write_text(text)
    _fails(artifacts, match)


def test_format_and_version_are_named_as_they_are(artifacts):
    _edit(artifacts, lambda raw: raw.update(format_version=99))
    assert f"v99, a newer format than the v{fmt.VERSION}" in _fails(artifacts, "v99")
    _edit(artifacts, lambda raw: raw.update(format_version=fmt.VERSION - 1))
    _fails(artifacts, f"format v{fmt.VERSION - 1}, an older format than the v{fmt.VERSION} this toolkit reads; "
                      "re-export with `glance-export onnx`")
    _edit(artifacts, lambda raw: raw.update(format_version="3"))
    _fails(artifacts, "format_version '3', which is not an integer")
    _edit(artifacts, lambda raw: raw.update(format_version=3, format="glance-engines"))
    _fails(artifacts, "not a GLANCE artifacts manifest .*'glance-engines'")


@pytest.mark.parametrize("change", [
    lambda raw: raw.update(stop_token_ids=[]),
    lambda raw: raw.update(branch_k=4),
    lambda raw: raw["limits"].update(max_context=64),
    lambda raw: raw.update(mask_token_id=raw["mask_token_id"] + 1),
    lambda raw: raw["graphs"]["draft"].update(num_layers=2),
    lambda raw: raw.pop("quantization"),
])
def test_an_edited_field_is_refused_as_an_edit(artifacts, change):
    _edit(artifacts, change)
    _fails(artifacts, "was edited after export .*content_sha256")


@pytest.mark.parametrize("change,match", [
    (lambda raw: raw.update(branch_k=0), "branch_k is 0; it must be an integer in 1.."),
    (lambda raw: raw.update(branch_k=10 ** 9), "branch_k is 1000000000"),
    (lambda raw: raw.update(branch_k=4), "branch_k 4 differs from the top-k the vocab graph"),
    (lambda raw: raw.update(branch_k=True), "branch_k is True"),
    (lambda raw: raw.update(mask_token_id=-1), "mask_token_id is -1"),
    (lambda raw: raw.update(mask_token_id=10 ** 6), "mask_token_id is 1000000; it must be an integer in 0.."),
    (lambda raw: raw.update(image_token_id=None), "image_token_id is None"),
    (lambda raw: raw.update(stop_token_ids=["2"]), r"stop_token_ids\[0\] is '2'"),
    (lambda raw: raw.update(stop_token_ids=7), "stop_token_ids must be a list"),
    (lambda raw: raw.update(block_size=0), "block_size is 0"),
    (lambda raw: raw.update(limits={}), "limits.max_context is missing"),
    (lambda raw: raw["limits"].update(max_tree=128), "limits.max_tree is 128; it must be an integer in 1..127"),
    (lambda raw: raw["limits"].update(max_context=2.5), "limits.max_context is 2.5"),
    (lambda raw: raw.update(float_io_dtype="int8"), "float_io_dtype is 'int8'; it must be one of float16, float32"),
    (lambda raw: raw.update(is_vl="yes"), "is_vl is 'yes'; it must be true or false"),
    (lambda raw: raw["graphs"]["target"].update(num_kv_heads=0), "graphs.target.num_kv_heads is 0"),
    (lambda raw: raw["graphs"]["draft"].update(context_width=65), "context_width 65 is not a whole number"),
    (lambda raw: raw["graphs"]["vision"]["index_params"].update(patch_size=0), "index_params.patch_size is 0"),
    (lambda raw: raw["graphs"]["vision"]["index_params"].update(merge_size=3), "merge_size differs"),
    (lambda raw: raw["graphs"]["target"].update(file="../../target.onnx"), "graphs.target.file"),
    (lambda raw: raw.update(files=["../outside.json"]), "must name a file inside the artifacts directory"),
    (lambda raw: raw.update(family="\ud800"), "lone surrogate"),
    (lambda raw: raw.update(graphs=[]), "graphs must be an object"),
])
def test_out_of_range_fields_are_one_line(artifacts, change, match):
    _rewrite(artifacts, change)
    assert "glance-export onnx" in _fails(artifacts, match)


def test_unhashed_file_is_refused(artifacts):
    _rewrite(artifacts, lambda raw: raw["file_hashes"].pop("tokenizer.json"))
    _fails(artifacts, "records no hash for tokenizer.json")


def test_toolkit_versions(artifacts):
    check_version("0.1.0", "0.1.3")
    check_version("1.2.0", "1.4.0")
    for exported, runtime in [("0.2.0", "0.1.0"), ("0.1.0", "0.2.0"), ("2.0.0", "1.9.0"), ("1.5.0", "1.4.0")]:
        with pytest.raises(GlanceError, match="re-export"):
            check_version(exported, runtime)
    _rewrite(artifacts, lambda raw: raw.update(toolkit_version="9.0.0"))
    _fails(artifacts, "exported by toolkit 9.0.0")


def test_source_hash_mismatch(exported, snapshot_dir):
    with pytest.raises(GlanceError, match="config.json differs"):
        check_source(load_manifest(exported[0]), snapshot_dir("qwen2_5_vl"))


def test_a_graph_swapped_in_with_its_hashes_rewritten_is_refused_when_opened(artifacts):
    """Every hash matching is not enough: the graph itself must be the one the manifest describes."""
    from glance_runtime.backends.ort_backend import OrtBackend
    from glance_runtime.store.integrity import record

    shutil.copy(artifacts / "draft.onnx", artifacts / "target.onnx")
    _rewrite(artifacts, lambda raw: raw["file_hashes"].update(record(artifacts, ["target.onnx"])))
    load_manifest(artifacts)  # every recorded hash holds
    with pytest.raises(GlanceError, match="target.onnx has inputs .* but its manifest records") as err:
        OrtBackend(artifacts, providers="cpu")
    assert "\n" not in str(err.value)


def test_real_graphs_match_their_manifest_entries(exported):
    from glance_runtime.backends.ort_backend import OrtBackend

    backend = OrtBackend(exported[0])
    assert set(backend.graphs) == {"target", "draft", "vocab", "vision"}
