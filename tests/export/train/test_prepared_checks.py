"""A prepared directory is checked whole when training opens it: its index, where each shard lies, each shard's
size, sha256, tensors and rows, and each sequence's place in its shard. Every damaged or edited directory is one
line before the first step; one written before shards recorded their hashes still trains."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from glance_export.cli import main as export_main
from glance_export.model.adapters import Snapshot
from glance_export.train.prepared import INDEX, PreparedData
from glance_runtime.errors import GlanceError


def prepare(model, tasks, out, max_new_tokens: int) -> None:
    assert export_main(["prepare-head-data", "--model", str(model), "--data", str(tasks), "--out", str(out),
                        "--max-new-tokens", str(max_new_tokens), "--shard-mb", "0.01", "--threads", "1"]) == 0


@pytest.fixture(scope="module")
def prepared(snapshot_dir, tmp_path_factory):
    """(model, a prepared directory of several shards, another one prepared from other answers)."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "tasks.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {n}." + " Go." * n}) + "\n"
                                              for n in range(4)))
    model = snapshot_dir("qwen2_5_vl")
    prepare(model, root / "tasks.jsonl", root / "a", 6)
    prepare(model, root / "tasks.jsonl", root / "b", 4)
    assert len(json.loads((root / "a" / INDEX).read_text())["shards"]) >= 2
    return model, root / "a", root / "b"


def edit_index(root, change) -> None:
    index = json.loads((root / INDEX).read_text())
    (root / INDEX).write_text(json.dumps(change(index)))


def shard(root, n: int = 0):
    return root / json.loads((root / INDEX).read_text())["shards"][n]["file"]


def swap(root) -> None:
    first, second = shard(root, 0), shard(root, 1)
    first.rename(root / "tmp")
    second.rename(first)
    (root / "tmp").rename(second)


def zero_tail(root) -> None:
    path = shard(root)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 64] + bytes(64))


def set_sequence(root, values) -> None:
    def change(index):
        index["shards"][0]["sequences"][0] = values(index["shards"][0])
        return index
    edit_index(root, change)


DAMAGE = {
    "missing-directory": (lambda root, other: shutil.rmtree(root), "does not exist"),
    "a-file-not-a-directory": (lambda root, other: (shutil.rmtree(root), root.write_text("x")), "not a directory"),
    "no-index": (lambda root, other: (root / INDEX).unlink(), f"no {INDEX}"),
    "index-not-json": (lambda root, other: (root / INDEX).write_text("{"), "cannot read"),
    "index-empty-list": (lambda root, other: (root / INDEX).write_text("[]"), "not a version"),
    "index-without-shards": (lambda root, other: edit_index(root, lambda i: {**i, "shards": None}), "'shards'"),
    "index-without-target": (lambda root, other: edit_index(root, lambda i: {k: v for k, v in i.items()
                                                                             if k != "target"}), "'target'"),
    "index-no-shards": (lambda root, other: edit_index(root, lambda i: {**i, "shards": []}), "no shards"),
    "sequence-not-a-triple": (lambda root, other: set_sequence(root, lambda s: s["sequences"][0][:2]), "not [offset"),
    "sequence-of-strings": (lambda root, other: set_sequence(root, lambda s: ["0", "1", "0"]), "not [offset"),
    "shards-swapped": (lambda root, other: swap(root), "another shard in its place"),
    "shard-truncated": (lambda root, other: shard(root).write_bytes(shard(root).read_bytes()[:100]), "bytes"),
    "shard-garbage": (lambda root, other: shard(root).write_bytes(os.urandom(shard(root).stat().st_size)), "sha256"),
    "shard-deleted": (lambda root, other: shard(root).unlink(), "missing"),
    "shard-tail-zeroed": (lambda root, other: zero_tail(root), "sha256"),
    "shard-from-another-directory": (lambda root, other: shutil.copy(shard(other), shard(root)), "shard_00000"),
    "shard-path-leaves": (lambda root, other: edit_index(root, lambda i: {**i, "shards": [
        {**i["shards"][0], "file": "../" + i["shards"][0]["file"]}]}), "not a file inside"),
    "shard-path-absolute": (lambda root, other: edit_index(root, lambda i: {**i, "shards": [
        {**i["shards"][0], "file": str(shard(other))}]}), "not a file inside"),
    "offset-past-the-end": (lambda root, other: set_sequence(root, lambda s: [s["rows"], 2, 1]), "outside the shard"),
    "length-past-the-end": (lambda root, other: set_sequence(root, lambda s: [0, s["rows"] + 1, 1]),
                            "outside the shard"),
    "negative-length": (lambda root, other: set_sequence(root, lambda s: [0, -3, 0]), "outside the shard"),
    "negative-offset": (lambda root, other: set_sequence(root, lambda s: [-1, 2, 1]), "outside the shard"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_or_edited_directory_is_refused_at_open(case, prepared, tmp_path):
    model, good, other = prepared
    root = tmp_path / "prep"
    shutil.copytree(good, root)
    damage, phrase = DAMAGE[case]
    damage(root, other)
    with pytest.raises(GlanceError) as refused:
        PreparedData.open(root, Snapshot(model))
    line = str(refused.value)
    assert phrase in line and "\n" not in line and ("prepare" in line or "restore" in line or "pass" in line), line


def test_a_shard_with_other_tensors_is_refused_without_hashes(prepared, tmp_path):
    model, good, _ = prepared
    root = tmp_path / "prep"
    shutil.copytree(good, root)
    edit_index(root, lambda i: {**i, "shards": [{k: v for k, v in s.items() if k not in ("sha256", "size")}
                                                for s in i["shards"]]})
    tensors = load_file(str(shard(root)))
    save_file({"taps": tensors["taps"][:, :-1].contiguous(), "ids": tensors["ids"]}, str(shard(root)))
    with pytest.raises(GlanceError, match="not BF16"):
        PreparedData.open(root, Snapshot(model))


def test_a_directory_written_before_shards_were_hashed_still_opens(prepared, tmp_path):
    model, good, _ = prepared
    root = tmp_path / "prep"
    shutil.copytree(good, root)
    edit_index(root, lambda i: {**i, "shards": [{"file": s["file"], "sequences": s["sequences"]}
                                                for s in i["shards"]]})
    data = PreparedData.open(root, Snapshot(model))
    assert len(data.sequences) == 4
    ids, taps = data(data.sequences[-1])
    assert len(ids) == len(taps) == data.sequences[-1].length


def test_train_head_refuses_a_damaged_directory_in_one_line(prepared, tmp_path, capsys):
    model, good, _ = prepared
    root = tmp_path / "prep"
    shutil.copytree(good, root)
    zero_tail(root)
    out = tmp_path / "head"
    rc = export_main(["train-head", "--model", str(model), "--prepared", str(root), "--out", str(out),
                      "--block-size", "4", "--steps", "2", "--batch", "2", "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "sha256" in err[0] and str(shard(root)) in err[0], err
    assert not out.exists()
