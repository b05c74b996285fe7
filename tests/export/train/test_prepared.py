"""Offline training: prepare-head-data writes the answers and taps once, in shards with an index, and
train-head --prepared trains from them the head online training trains, loading only the target's
embedding and LM head."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from glance_export.cli import main as export_main
from glance_export.model.adapters import Snapshot
from glance_export.train.prepared import INDEX, check_room, token_layers
from glance_runtime.errors import GlanceError
from support import make_image, make_snapshot

COMMON = ["--block-size", "4", "--anchors", "4", "--batch", "3", "--steps", "3", "--lr", "1e-2", "--threads", "1"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    rows = []
    for i in range(5):
        make_image(root / f"{i}.png", 56 + 28 * (i % 2), 56 + 28 * (i % 3), seed=i)
        rows.append(json.dumps({"image": f"{i}.png", "prompt": "What is shown?" + " Look." * i}))
    (root / "tasks.jsonl").write_text("\n".join(rows) + "\n")
    return root / "tasks.jsonl"


def weights(head):
    state = load_file(str(head / "model.safetensors"))
    return torch.cat([state[k].flatten() for k in sorted(state)])


def test_prepared_training_equals_online_training(snapshot_dir, tasks, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    prepared = tmp_path / "prepared"
    assert export_main(["prepare-head-data", "--model", str(model), "--data", str(tasks), "--out", str(prepared),
                        "--max-new-tokens", "8", "--shard-mb", "0.01", "--gen-batch", "2"]) == 0
    log = capsys.readouterr().out
    assert "GiB" in log and "in 1 shards" not in log  # the disk estimate comes first; a small shard size: several
    index = json.loads((prepared / INDEX).read_text())
    assert len(index["shards"]) > 1 and sum(len(s["sequences"]) for s in index["shards"]) == 5
    shard = load_file(str(prepared / index["shards"][0]["file"]))
    assert shard["taps"].dtype == torch.bfloat16 and shard["taps"].shape[0] == shard["ids"].shape[0]

    assert export_main(["train-head", "--model", str(model), "--prepared", str(prepared), "--out",
                        str(tmp_path / "offline"), *COMMON]) == 0
    assert "5 prepared sequences" in capsys.readouterr().out
    assert export_main(["train-head", "--model", str(model), "--data", str(tasks), "--out", str(tmp_path / "online"),
                        "--max-new-tokens", "8", *COMMON]) == 0
    offline, online = weights(tmp_path / "offline"), weights(tmp_path / "online")
    # the same sequences and anchors; only the taps' bf16 rounding differs
    assert float((offline - online).norm() / online.norm()) < 1e-2


def test_prepared_data_of_another_head_shape_is_refused(snapshot_dir, tasks, tmp_path, capsys):
    model = snapshot_dir("qwen2_5_vl")
    prepared = tmp_path / "prepared"
    assert export_main(["prepare-head-data", "--model", str(model), "--data", str(tasks), "--out", str(prepared),
                        "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    rc = export_main(["train-head", "--model", str(model), "--prepared", str(prepared), "--out", str(tmp_path / "h"),
                      "--layers", "2", *COMMON])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "--layers" in err[0]


def test_a_disk_without_room_is_refused_before_writing(tmp_path):
    with pytest.raises(GlanceError, match="free space"):
        check_room(tmp_path / "out", shutil.disk_usage(tmp_path).free * 2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_token_layers_are_the_models_own(tmp_path, tied):
    snap = Snapshot(make_snapshot(tmp_path / "m", "qwen2_5_vl", layers=1, tied=tied))
    model = snap.load_model()
    embed, lm_head = token_layers(snap, torch.device("cpu"))
    assert torch.equal(embed.weight, model.get_input_embeddings().weight)
    assert torch.equal(lm_head.weight, model.get_output_embeddings().weight)
