"""Five bugs users hit, each reproduced as a user hit it and now answered properly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from glance_export.model.adapters import Snapshot
from glance_export.cli import main as export_main
from glance_export.model.torch_backend import greedy_reference
from glance_runtime.cli.run import main as run_main
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from support import make_snapshot

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECEIPT = ["--image", str(EXAMPLES / "demo" / "receipt.png"), "--prompt", "What is the total?"]


def one_line_error(capsys, code: int) -> str:
    """Exit 2, nothing on stdout, exactly one stderr line and no traceback."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


def test_train_head_on_a_target_that_answers_with_the_image_pad_token(images, tmp_path, capsys):
    # A random Qwen2-VL whose greedy answer to this prompt contains <|image_pad|>: the tapping pass used
    # to count that answer token as an image slot and fail in transformers.
    model = make_snapshot(tmp_path / "qwen2_vl", "qwen2_vl", seed=5)
    snap = Snapshot(model)
    prompt = snap.build_prompt("Describe the image.", images["wide"])
    assert snap.image_token_id in greedy_reference(snap.load_model(), snap, prompt, 32, snap.stop_token_ids)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"image": str(images["wide"]), "prompt": "Describe the image."}) + "\n")
    assert export_main(["train-head", "--model", str(model), "--data", str(tasks), "--out", str(tmp_path / "head"),
                        "--block-size", "4", "--steps", "2", "--batch", "1", "--anchors", "4",
                        "--max-new-tokens", "32"]) == 0
    assert (tmp_path / "head" / "model.safetensors").is_file()


@pytest.mark.parametrize("flag, names", [(["--budget", "5000"], ["--budget 5000", "0..63"]),
                                         (["--branch-k", "99"], ["--branch-k 99", "1..8"])])
def test_flags_the_artifacts_cannot_serve_are_refused_before_decoding(flag, names, capsys):
    line = one_line_error(capsys, run_main(RECEIPT + flag))
    assert all(n in line for n in names), line


def test_budget_above_max_tree_is_fine_when_the_tree_cannot_reach_it(capsys):
    """A budget is capped by what B-1 offsets of top-k can give: chain of 15 nodes fits a 64-row pass."""
    assert run_main(RECEIPT + ["--budget", "5000", "--branch-k", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"]


def test_missing_model_directory_is_named(capsys, tmp_path):
    line = one_line_error(capsys, run_main(["--model", "/does/not/exist", "--prompt", "x"]))
    assert "--model /does/not/exist does not exist" in line
    line = one_line_error(capsys, run_main(["--model", str(tmp_path), "--head", str(tmp_path / "nope"),
                                            "--prompt", "x"]))
    assert "--head" in line and "does not exist" in line


def test_a_flipped_byte_in_target_onnx_is_caught_by_the_manifest_hash(tmp_path, capsys):
    art = Path(shutil.copytree(DEFAULT_ARTIFACTS, tmp_path / "art"))
    assert run_main(["--artifacts", str(art), *RECEIPT]) == 0  # intact: answers, and stamps the hashes
    capsys.readouterr()
    graph = art / "target.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0x01
    graph.write_bytes(data)
    line = one_line_error(capsys, run_main(["--artifacts", str(art), *RECEIPT]))
    assert "target.onnx does not match the sha256" in line and "re-export" in line


@pytest.mark.parametrize("where", ["under_a_file", "in_proc"])
def test_onnx_out_that_cannot_be_created_is_one_line(where, snapshot_dir, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = blocker / "art" if where == "under_a_file" else Path("/proc/glance/art")
    model, head = str(snapshot_dir("qwen2")), str(tmp_path / "head")
    assert export_main(["init-head", "--model", model, "--out", head, "--block-size", "4"]) == 0
    capsys.readouterr()
    line = one_line_error(capsys, export_main(["onnx", "--model", model, "--head", head, "--out", str(out)]))
    assert f"cannot create {out}" in line
