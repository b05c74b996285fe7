"""The head trainer really learns: after a short run on a few prompts, GLANCE accepts long blocks on them
while staying identical to greedy; and its checkpoint loads like any published head."""
from __future__ import annotations

import json

import pytest

from glance_export.audit.greedy_audit import audit
from glance_runtime.formats.tasks import read as read_tasks
from glance_export.cli import main as export_main
from glance_export.model.head import load_head
from glance_runtime.decode.loop import DecodeConfig
from glance_runtime.backends.registry import Source, open_session
from support import image_tasks


@pytest.fixture(scope="module")
def task_file(images, tmp_path_factory):
    return image_tasks(images, tmp_path_factory.mktemp("train"))


def test_trained_head_accepts_long_blocks_and_stays_lossless(snapshot_dir, task_file, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    out = tmp_path / "head"
    assert export_main(["train-head", "--model", str(model), "--data", str(task_file), "--out", str(out),
                        "--block-size", "8", "--steps", "60", "--lr", "1e-2", "--batch", "3", "--anchors", "12",
                        "--max-new-tokens", "24", "--seed", "0", "--eval-data", str(task_file), "--eval-every", "30",
                        "--eval-budget", "31", "--log-every", "20"]) == 0
    log = capsys.readouterr().out
    assert "stage 1/2" in log and "step 60/60" in log and "ETA" in log
    assert load_head(out).config.block_size == 8

    session = open_session(Source("torch", model=model, head=out), DecodeConfig(max_new_tokens=24, budget=31))
    report = audit(session, read_tasks(task_file))
    assert report["identical"] == report["n"] == 3
    assert report["tau"] > 3.0, report

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [20, 30, 40, 60]
    assert all(len(r["accuracy"]) == 7 and r["lr"] > 0 and r["samples_per_s"] > 0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    final = records[-1]["held_out"]
    assert set(final["tau"]) == {"15", "31"} and "held_out" in records[1] and "held_out" not in records[0]
    # the held-out measurement is the real decode loop: the audit of the saved head finds the same tau
    assert final["tau"]["31"] == pytest.approx(report["tau"], abs=1e-3)
    accept = final["accept"]
    assert len(accept) == 7 and accept == sorted(accept, reverse=True) and accept[0] > 0.5
    card = (out / "README.md").read_text()
    assert "tasks.jsonl" in card and "steps: 60 of 60" in card and f"tau at budget 31: {final['tau']['31']:.2f}" in card


def test_untrained_head_accepts_little(snapshot_dir, task_file, tmp_path):
    """The control for the test above: the same prompts with an untrained head."""
    model = snapshot_dir("qwen2_5_vl")
    assert export_main(["init-head", "--model", str(model), "--out", str(tmp_path / "h"), "--block-size", "8"]) == 0
    report = audit(open_session(Source("torch", model=model, head=tmp_path / "h"),
                                DecodeConfig(max_new_tokens=24, budget=31)), read_tasks(task_file))
    assert report["identical"] == 3 and report["tau"] < 1.5
