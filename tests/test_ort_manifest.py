"""manifest.json loading: a real export loads; stale, foreign or incomplete ones fail in one line with the fix."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from glance_export.adapters import Snapshot
from glance_export.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_runtime.errors import GlanceError
from glance_runtime.manifest import FORMAT_VERSION, check_source, check_version, load_manifest


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


def _edit(path: Path, change) -> None:
    raw = json.loads((path / "manifest.json").read_text())
    change(raw)
    (path / "manifest.json").write_text(json.dumps(raw))


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
    check_source(m, exported[1])


def test_missing_pieces(artifacts, tmp_path):
    _fails(tmp_path / "nowhere", "does not exist")
    (artifacts / "vision.onnx").unlink()
    assert "glance-export onnx" in _fails(artifacts, "lacks the vision graph")
    (artifacts / "tokenizer.json").unlink()
    (artifacts / "manifest.json").unlink()
    _fails(artifacts, "no manifest.json")


def test_missing_listed_file(artifacts):
    (artifacts / "tokenizer.json").unlink()
    _fails(artifacts, "lacks tokenizer.json")


def test_bad_json_format_and_fields(artifacts):
    _edit(artifacts, lambda raw: raw.update(format_version=99))
    _fails(artifacts, "v99")
    _edit(artifacts, lambda raw: raw.update(format_version=FORMAT_VERSION, limits={}))
    _fails(artifacts, "incomplete or malformed")
    (artifacts / "manifest.json").write_text("{not json")
    _fails(artifacts, "not valid JSON")


def test_toolkit_versions(artifacts):
    check_version("0.1.0", "0.1.3")
    check_version("1.2.0", "1.4.0")
    for exported, runtime in [("0.2.0", "0.1.0"), ("0.1.0", "0.2.0"), ("2.0.0", "1.9.0"), ("1.5.0", "1.4.0")]:
        with pytest.raises(GlanceError, match="re-export"):
            check_version(exported, runtime)
    _edit(artifacts, lambda raw: raw.update(toolkit_version="9.0.0"))
    _fails(artifacts, "exported by toolkit 9.0.0")


def test_source_hash_mismatch(exported, snapshot_dir):
    with pytest.raises(GlanceError, match="config.json differs"):
        check_source(load_manifest(exported[0]), snapshot_dir("qwen2_5_vl"))
