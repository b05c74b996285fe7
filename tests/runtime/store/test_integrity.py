"""Integrity: every file an export writes is hashed into its manifest and checked on load, cheaply
(stamps by size/times/inode, so a big file is hashed again only when it changed); a damaged entry of
the runtime's export cache is exported again rather than used."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from glance_runtime.store.atomic import MARKER
import pytest

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_runtime.store import integrity
from glance_runtime.errors import GlanceError
from glance_runtime.formats.engines import EngineFile
from glance_runtime.store.integrity import Stamps, sha256, verify_engines, verify_files
from glance_runtime.formats import artifacts as artifacts_format
from glance_runtime.formats.artifacts import read as load_manifest
from glance_runtime.backends.registry import exported_artifacts
from support import export_once


@pytest.fixture(scope="module")
def export(snapshot_dir, tmp_path_factory) -> Path:
    return export_once(snapshot_dir, tmp_path_factory, "qwen2_5_vl")[2]


@pytest.fixture
def copy(export, tmp_path) -> Path:
    return Path(shutil.copytree(export, tmp_path / "art"))


@pytest.fixture
def stamp_now(monkeypatch):
    """Stamp files however fresh (the racy-write guard otherwise skips files written this second)."""
    monkeypatch.setattr(integrity, "RACY_NS", -1)


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(data)


def test_manifest_hashes_every_file_beside_it(export):
    raw = json.loads((export / "manifest.json").read_text())
    on_disk = {p.name for p in export.iterdir() if p.is_file()} - {"manifest.json", MARKER}
    assert set(raw["file_hashes"]) == on_disk
    for name, entry in raw["file_hashes"].items():
        assert entry == {"sha256": sha256(export / name), "size": (export / name).stat().st_size}


@pytest.mark.parametrize("name", ["target.onnx", "vision.onnx", "draft.onnx", "vocab.onnx", "tokenizer.json",
                                  "chat_template.jinja", "preprocessor_config.json"])
def test_one_changed_byte_in_any_file_is_caught(copy, name):
    _flip(copy / name)
    with pytest.raises(GlanceError, match=f"{name} does not match the sha256"):
        load_manifest(copy)


def test_truncated_file_is_named_with_its_sizes(copy):
    data = (copy / "target.onnx").read_bytes()
    (copy / "target.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(GlanceError, match=rf"target.onnx is {len(data) // 2} bytes but its manifest records "
                                          rf"{len(data)}"):
        load_manifest(copy)


def test_export_without_hashes_is_refused(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    del raw["file_hashes"]
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(GlanceError, match="was edited after export.*re-export"):
        load_manifest(copy)
    artifacts_format.write(copy, raw)  # written without them, content hash and all
    with pytest.raises(GlanceError, match="file_hashes is missing.*re-export"):
        load_manifest(copy)


def test_stamped_files_are_not_hashed_again_until_they_change(copy, stamp_now):
    load_manifest(copy)  # hashes everything and stamps it
    stamps = Stamps(copy)
    assert set(stamps.entries) >= {"target.onnx", "vocab.onnx", "tokenizer.json"}
    # Prove the stamp is what answers: a forged stamp digest is believed while the file's stat is unchanged...
    stamps.entries["vocab.onnx"][-1] = "0" * 64
    stamps.changed = True
    stamps.save()
    with pytest.raises(GlanceError, match="vocab.onnx does not match"):
        load_manifest(copy)
    # ...and dropped as soon as the file's times move: the file is hashed again and found intact.
    st = (copy / "vocab.onnx").stat()
    os.utime(copy / "vocab.onnx", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    load_manifest(copy)


def test_same_size_rewrite_with_restored_mtime_is_still_caught(copy, stamp_now):
    load_manifest(copy)
    path = copy / "draft.onnx"
    st = path.stat()
    _flip(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as stamped; ctime cannot be reset
    with pytest.raises(GlanceError, match="draft.onnx does not match"):
        load_manifest(copy)


def test_fresh_files_are_never_stamped(copy):
    """A write in the same clock tick as a hash would leave size and times unchanged: not trusted."""
    (copy / "tokenizer.json").write_bytes((copy / "tokenizer.json").read_bytes())
    load_manifest(copy)
    assert "tokenizer.json" not in Stamps(copy).entries


def test_verify_engines_reads_an_engine_record(tmp_path):
    (tmp_path / "target.engine").write_bytes(b"plan" * 100)
    files = [EngineFile("target.engine", 400, sha256(tmp_path / "target.engine"))]
    verify_engines(tmp_path, files)
    _flip(tmp_path / "target.engine", at=7)
    with pytest.raises(GlanceError, match="target.engine does not match.*glance-export build"):
        verify_engines(tmp_path, files)
    with pytest.raises(GlanceError, match="gone.engine is missing"):
        verify_files(tmp_path, {"gone.engine": {"sha256": "0"}}, "rebuild")


def test_damaged_cache_entry_is_exported_again(snapshot_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path / "cache"))
    snap = Snapshot(snapshot_dir("qwen2"))
    head = save_head(init_head(head_config_for(snap, 1, 4, pick_mask_token(snap)), seed=0), tmp_path / "head")
    lines: list[str] = []
    entry = exported_artifacts(snap.path, head, lines.append)
    assert any("exporting" in line for line in lines)
    lines.clear()
    assert exported_artifacts(snap.path, head, lines.append) == entry and not lines  # intact: reused
    for damage in (lambda: _flip(entry / "target.onnx"), lambda: (entry / "vocab.onnx").unlink(),
                   lambda: (entry / "manifest.json").write_text("{")):
        damage()
        lines.clear()
        assert exported_artifacts(snap.path, head, lines.append) == entry
        assert "is unusable" in lines[0] and any("exporting" in line for line in lines)
        load_manifest(entry)
