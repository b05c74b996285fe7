"""Training refuses what would only train on to a broken head: a head to resume whose weights are not finite, a loss
that turns non-finite (it stops, keeping the last good checkpoint), a --prepared or --resume path that is missing or
no directory, and an EAGLE-3 head drafting over fewer tokens than a draft offset branches into. Each is one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glance_export.cli import main as export_main
from glance_export.train.checkpoint import STATE_FILE
from glance_runtime.defaults import BRANCH_K

from support import export_refusal

COMMON = ["--steps", "3", "--batch", "2", "--max-new-tokens", "6", "--threads", "1"]
SHORT = ["--block-size", "4", "--anchors", "2", *COMMON]  # a GLANCE head's


@pytest.fixture
def tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Count to five.", "Name a colour.")))
    return path


def head(model, out, arch: str) -> None:
    extra = ["--block-size", "4"] if arch == "glance" else ["--arch", "eagle3"]
    assert export_main(["init-head", "--model", str(model), "--out", str(out), *extra]) == 0


@pytest.mark.parametrize("arch", ["glance", "eagle3"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_resuming_a_head_with_non_finite_weights_is_refused_naming_the_tensor(arch, bad, snapshot_dir, tasks,
                                                                             tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    resume = tmp_path / "resume"
    head(model, resume, arch)
    weights = load_file(str(resume / "model.safetensors"))
    name = next(k for k, v in weights.items() if v.is_floating_point() and v.dim() == 2)
    weights[name].view(-1)[3] = bad
    save_file(weights, str(resume / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    line = export_refusal(capsys, ["train-head", "--model", model, "--data", tasks, "--out", out, "--resume", resume,
                            "--arch", arch, *(SHORT if arch == "glance" else COMMON)])
    assert name in line and str(resume) in line and "NaN or infinite" in line, line
    assert not out.exists()


def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(snapshot_dir, tasks, tmp_path, capsys):
    """A learning rate of 1e30 sends the weights to about 1e30 in the first step, so the second step's loss
    overflows: training stops there, and the head left is step 1's checkpoint, finite."""
    model = snapshot_dir("qwen2_5_vl")
    out = tmp_path / "head"
    line = export_refusal(capsys, ["train-head", "--model", model, "--data", tasks, "--out", out, *SHORT, "--lr", "1e30",
                            "--checkpoint-every", "1"])
    assert "step 2" in line and "not finite" in line and str(out) in line, line
    weights = load_file(str(out / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    with safe_open(str(out / STATE_FILE), "pt") as f:
        assert json.loads(f.metadata()["state"])["step"] == 1


@pytest.mark.parametrize("where", ["missing", "a-file"])
def test_prepared_data_that_is_no_directory_is_refused_in_one_line(where, snapshot_dir, tasks, tmp_path, capsys):
    prepared = tasks if where == "a-file" else tmp_path / "nowhere"
    out = tmp_path / "out"
    line = export_refusal(capsys, ["train-head", "--model", snapshot_dir("qwen2_5_vl"), "--prepared", prepared, "--out", out,
                            *SHORT])
    words = "is not a directory" if where == "a-file" else "does not exist"
    assert f"--prepared {prepared} {words}" in line and "prepare-head-data" in line, line
    assert not out.exists()


@pytest.mark.parametrize("arch", ["glance", "eagle3"])
def test_resuming_a_missing_head_says_it_does_not_exist(arch, snapshot_dir, tasks, tmp_path, capsys):
    resume, out = tmp_path / "nowhere", tmp_path / "out"
    line = export_refusal(capsys, ["train-head", "--model", snapshot_dir("qwen2_5_vl"), "--data", tasks, "--out", out,
                            "--resume", resume, "--arch", arch, "--steps", "1"])
    assert f"--resume {resume} does not exist" in line and "is a glance head" not in line, line
    assert not out.exists()


@pytest.mark.parametrize("n", [1, BRANCH_K - 1])
def test_an_eagle3_head_drafting_over_fewer_tokens_than_the_branching_is_refused(n, snapshot_dir, tmp_path, capsys):
    out = tmp_path / "head"
    line = export_refusal(capsys, ["init-head", "--model", snapshot_dir("qwen2_5_vl"), "--out", out, "--arch", "eagle3",
                            "--draft-vocab", n])
    assert f"--draft-vocab must be >= {BRANCH_K}" in line, line
    assert not out.exists()
    assert export_main(["init-head", "--model", str(snapshot_dir("qwen2_5_vl")), "--out", str(out), "--arch", "eagle3",
                        "--draft-vocab", str(BRANCH_K)]) == 0
