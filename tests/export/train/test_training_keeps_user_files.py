"""Head training and data preparation replace only what they wrote, read only regular files of a bounded
size, and refuse every other input in one line before any work."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from glance_export.cli import main as export_main
from glance_export.train.data_files import Tally, read_samples
from support import tree

TRAIN = ["--steps", "2", "--batch", "2", "--max-new-tokens", "8", "--block-size", "4", "--anchors", "4"]


@pytest.fixture
def work(snapshot_dir, images, tmp_path):
    """A head made by init-head, and a task file whose images lie outside it."""
    model = snapshot_dir("qwen2_5_vl")
    assert export_main(["init-head", "--model", str(model), "--out", str(tmp_path / "H"), "--block-size", "4"]) == 0
    shutil.copy(images["wide"], tmp_path / "wide.png")
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"prompt": "What is shown?", "image": "wide.png"}) + "\n")
    return model, tmp_path


def _refused(capsys, argv: list[str], *words: str) -> str:
    rc = export_main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc != 0 and len(err) == 1 and "Traceback" not in err[0], err
    assert all(w in err[0] for w in words), err
    return err[0]


def test_held_out_data_inside_the_head_is_neither_deleted_nor_an_output(work, capsys):
    model, root = work
    heldout = root / "H" / "heldout.jsonl"
    heldout.write_text((root / "tasks.jsonl").read_text().replace("wide.png", "../wide.png"))
    before = tree(root)
    _refused(capsys, ["train-head", "--model", str(model), "--data", str(root / "tasks.jsonl"), "--eval-data",
                      str(heldout), "--out", str(root / "H"), *TRAIN], str(root / "H"), "heldout.jsonl")
    assert tree(root) == before


def test_images_a_user_put_in_the_head_directory_stay(work, capsys):
    model, root = work
    (root / "H" / "imgs").mkdir()
    for i in range(4):
        shutil.copy(root / "wide.png", root / "H" / "imgs" / f"{i}.png")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": "What?", "image": f"H/imgs/{i}.png"}) + "\n" for i in range(4)))
    before = tree(root)
    _refused(capsys, ["train-head", "--model", str(model), "--data", str(data), "--out", str(root / "H"), *TRAIN],
             "imgs", "move it out")
    assert tree(root) == before


def test_prepared_data_directory_keeps_images_put_there(work, capsys):
    model, root = work
    prepared = root / "P"
    assert export_main(["prepare-head-data", "--model", str(model), "--data", str(root / "tasks.jsonl"), "--out",
                        str(prepared), "--max-new-tokens", "4"]) == 0
    (prepared / "imgs").mkdir()
    shutil.copy(root / "wide.png", prepared / "imgs" / "0.png")
    before = tree(root)
    _refused(capsys, ["prepare-head-data", "--model", str(model), "--data", str(root / "tasks.jsonl"), "--out",
                      str(prepared), "--max-new-tokens", "4"], "imgs")
    assert tree(root) == before


def test_a_link_to_the_head_directory_trains_into_it(work, capsys):
    model, root = work
    (root / "link").symlink_to(root / "H")
    assert export_main(["train-head", "--model", str(model), "--data", str(root / "tasks.jsonl"), "--out",
                        str(root / "link"), *TRAIN]) == 0
    assert (root / "link").is_symlink() and (root / "H" / "model.safetensors").is_file()
    assert "trainer_state.pt" not in os.listdir(root / "H")
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no sibling left


@pytest.mark.parametrize("shape, words", [("dir", "is a directory"), ("dangling", "dangling symbolic link"),
                                          ("device", "character device")])
@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_a_data_path_that_is_no_file_is_named_with_its_flag(work, capsys, flag, shape, words):
    model, root = work
    bad = root / "bad.jsonl"
    if shape == "dir":
        bad.mkdir()
    elif shape == "dangling":
        bad.symlink_to(root / "gone.jsonl")
    else:
        bad = "/dev/zero"
    data = [str(bad) if flag == "--data" else str(root / "tasks.jsonl")]
    extra = ["--eval-data", str(bad)] if flag == "--eval-data" else []
    what = "training data" if flag == "--data" else "--eval-data"
    _refused(capsys, ["train-head", "--model", str(model), "--data", *data, *extra, "--out", str(root / "new"),
                      *TRAIN], what, str(bad), words)
    assert not (root / "new").exists()


def test_a_fifo_as_data_or_beside_the_output_blocks_nothing(work):
    """In children with a deadline: a blocked open would hang the test run."""
    model, root = work
    os.mkfifo(root / "fifo.png")
    os.mkfifo(root / f".h.glance-{'d' * 32}.json")
    cli = [sys.executable, "-m", "glance_export"]
    data = subprocess.run([*cli, "train-head", "--model", str(model), "--data", str(root / "fifo.png"), "--out",
                           str(root / "new"), *TRAIN], capture_output=True, text=True, timeout=120)
    assert data.returncode != 0 and "FIFO" in data.stderr and "Traceback" not in data.stderr, data.stderr
    init = subprocess.run([*cli, "init-head", "--model", str(model), "--out", str(root / "h"), "--block-size", "4"],
                          capture_output=True, text=True, timeout=120)
    assert init.returncode == 0, init.stderr
    assert (root / "h" / "model.safetensors").is_file() and (root / f".h.glance-{'d' * 32}.json").exists()


def test_a_huge_sparse_data_file_is_refused_by_its_size(work, capsys):
    model, root = work
    huge = root / "huge.jsonl"
    with open(huge, "wb") as fh:
        fh.truncate(5 << 30)
    tally = Tally()
    with pytest.raises(Exception, match="more than the 4 GiB"):
        read_samples([huge], tally)


def test_rows_too_deep_or_not_text_are_counted_and_a_bom_is_no_row(work, capsys):
    model, root = work
    row = (root / "tasks.jsonl").read_text()
    data = root / "mixed.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    data.write_bytes(b"\xef\xbb\xbf" + (row * 18 + deep + "\n" + '{"prompt": "\\ud800", "image": "wide.png"}\n')
                     .encode())
    tally = Tally()
    samples = read_samples([data], tally)
    assert len(samples) == 18 and tally.rows == 20 and tally.bad == 2
    assert "nested too deeply" in tally.reasons[0] and "lone surrogate" in tally.reasons[1]
    listed = root / "deep.json"
    listed.write_text(deep)
    _refused(capsys, ["train-head", "--model", str(model), "--data", str(listed), "--out", str(root / "new"), *TRAIN],
             "nested too deeply", str(listed))
    lone = root / "lone.jsonl"
    lone.write_text('{"prompt": "\\ud800 what?", "image": "wide.png"}\n')
    _refused(capsys, ["train-head", "--model", str(model), "--data", str(lone), "--out", str(root / "new"), *TRAIN],
             "lone surrogate")
