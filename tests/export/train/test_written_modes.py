"""Head weights, trainer state and prepared shards are ordinary files, readable as the umask allows like every other
output (safetensors writes through a private temporary file, which left them 0600 beside 0644 neighbours)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from glance_export.cli import main as export_main


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(directory) -> dict[str, str]:
    return {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in directory.iterdir() if p.is_file()}


def test_heads_state_and_prepared_shards_are_written_0644(umask_022, snapshot_dir, tmp_path, capsys):
    model = str(snapshot_dir("qwen2_5_vl"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Count to five.", "Name a colour.")))
    glance, eagle3, trained, prepared = (tmp_path / n for n in ("glance", "eagle3", "trained", "prepared"))
    assert export_main(["init-head", "--model", model, "--out", str(glance), "--block-size", "4"]) == 0
    assert export_main(["init-head", "--model", model, "--out", str(eagle3), "--arch", "eagle3"]) == 0
    assert export_main(["train-head", "--model", model, "--data", str(tasks), "--out", str(trained), "--block-size",
                        "4", "--steps", "3", "--batch", "2", "--anchors", "2", "--max-new-tokens", "6",
                        "--checkpoint-every", "1", "--time-budget", "0", "--threads", "1"]) == 0  # keeps its state
    assert export_main(["prepare-head-data", "--model", model, "--data", str(tasks), "--out", str(prepared),
                        "--max-new-tokens", "6", "--threads", "1"]) == 0
    for directory, weights in ((glance, "model.safetensors"), (eagle3, "model.safetensors"),
                               (trained, "trainer_state.safetensors"), (prepared, "shard_00000.safetensors")):
        found = modes(directory)
        assert weights in found and set(found.values()) == {"0o644"}, (directory.name, found)
