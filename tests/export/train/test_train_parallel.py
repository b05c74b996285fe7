"""train-head under torchrun (gloo on the CPU): N processes split each global batch, so 2 processes at batch 2
train the head 1 process at batch 4 does (a GLANCE head and an EAGLE-3 head), and a run stopped under 2
processes continues under 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glance_export.model.adapters import Snapshot
from glance_export.model.head import head_config_for, init_head, pick_mask_token
from glance_export.train.checkpoint import STATE_FILE
from support import make_image

pytestmark = pytest.mark.slow  # training runs under torchrun

REPO = Path(__file__).resolve().parents[3]
COMMON = ["--block-size", "4", "--anchors", "4", "--max-new-tokens", "8", "--threads", "1", "--lr", "1e-2"]
EAGLE3 = ["--arch", "eagle3", "--ttt-steps", "3", "--max-new-tokens", "8", "--threads", "1", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    rows = []
    for i in range(6):
        make_image(root / f"{i}.png", 56 + 28 * (i % 3), 56 + 28 * (i // 3), seed=i)
        rows.append(json.dumps({"image": f"{i}.png", "prompt": "What is shown?" + " Look closely." * i}))
    (root / "tasks.jsonl").write_text("\n".join(rows) + "\n")
    return root / "tasks.jsonl"


def train(model, tasks, out, processes: int, *flags: str, common: list[str] = COMMON) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "runtime")]), OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] \
        if processes > 1 else [sys.executable]
    done = subprocess.run([*launcher, "-m", "glance_export", "train-head", "--model", str(model), "--data", str(tasks),
                           "--out", str(out), *common, *flags], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].flatten() for k in sorted(state)])


def weights(head: Path) -> torch.Tensor:
    return flat(load_file(str(head / "model.safetensors")))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def one_process(snapshot_dir, tasks, tmp_path_factory):
    """The reference: 4 steps of 4 sequences in one process."""
    out = tmp_path_factory.mktemp("one") / "head"
    train(snapshot_dir("qwen2_5_vl"), tasks, out, 1, "--steps", "4", "--batch", "4")
    return weights(out)


def test_two_processes_at_batch_2_train_the_head_one_at_batch_4_does(snapshot_dir, tasks, one_process, tmp_path):
    model = snapshot_dir("qwen2_5_vl")
    log = train(model, tasks, tmp_path / "two", 2, "--steps", "4", "--batch", "2")
    assert "4 a step over 2 processes" in log and log.count("saved head to") == 1  # only the first process logs
    cfg = head_config_for(Snapshot(model), 1, 4, pick_mask_token(Snapshot(model)))
    init = flat(init_head(cfg, 0).state_dict())
    assert relative(one_process, init) > 1e-2  # the steps moved the weights ...
    assert relative(weights(tmp_path / "two"), one_process) < 1e-5  # ... and both runs moved them the same way


def test_a_run_stopped_under_two_processes_continues_under_one(snapshot_dir, tasks, one_process, tmp_path):
    model = snapshot_dir("qwen2_5_vl")
    resumed = tmp_path / "resumed"
    log = train(model, tasks, resumed, 2, "--steps", "4", "--batch", "2", "--time-budget", "0")
    assert "time budget reached after 1 steps" in log and (resumed / STATE_FILE).is_file()
    log = train(model, tasks, resumed, 1, "--steps", "4", "--batch", "4")
    assert "resuming from the checkpoint" in log and "at step 1" in log and "step 4/4" in log
    assert not (resumed / STATE_FILE).exists()
    assert relative(weights(resumed), one_process) < 1e-5


def test_two_processes_train_an_eagle3_head_as_one_does(snapshot_dir, tasks, tmp_path):
    """The same split for EAGLE-3's training-time test: every process drafts over the same vocabulary (counted
    over all the answers), and the two half batches move the weights as the whole one does."""
    model = snapshot_dir("qwen2_5_vl")
    train(model, tasks, tmp_path / "one", 1, "--steps", "4", "--batch", "4", common=EAGLE3)
    log = train(model, tasks, tmp_path / "two", 2, "--steps", "4", "--batch", "2", common=EAGLE3)
    assert "4 a step over 2 processes" in log
    one, two = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    assert torch.equal(one["d2t"], two["d2t"])
    assert relative(flat(two), flat(one)) < 1e-5
