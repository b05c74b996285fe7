"""Every output path of `glance-export` keeps what it did not make: a user's file or folder, a model's
config, another command's output, and hidden siblings that look like temporary names. Each command runs
for real, in process, on the embedded default; it refuses in one line before any work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from glance_export import cli
from glance_export.build import local_gpu as devices
from glance_export.build.local_gpu import BuildGpu
from glance_runtime.defaults import DEFAULT_ARTIFACTS, DEFAULT_HEAD, DEFAULT_MODEL
from support import assert_kept, tree

REPO = Path(__file__).resolve().parents[3]
TASKS = REPO / "examples" / "receipt" / "tasks.jsonl"
DIR_VICTIMS = ("user-file", "user-dir", "other-format-dir")
FILE_VICTIMS = ("user-file", "config-json", "other-format-file", "binary-file", "user-dir")

COMMANDS = {  # command: (its arguments with OUT for the output, what may lie there)
    "onnx": (["onnx", "--model", DEFAULT_MODEL, "--head", DEFAULT_HEAD, "--out", "OUT"], DIR_VICTIMS),
    "build": (["build", "--target", "rtx", "--artifacts", DEFAULT_ARTIFACTS, "--out", "OUT"], DIR_VICTIMS),
    "build-plan-only": (["build", "--target", "jetson-orin", "--plan-only", "--artifacts", DEFAULT_ARTIFACTS,
                         "--out", "OUT"], DIR_VICTIMS),
    "build-timing-cache": (["build", "--target", "datacenter", "--artifacts", DEFAULT_ARTIFACTS, "--timing-cache",
                            "OUT", "--out", "ENGINES"], FILE_VICTIMS[:-1] + ("user-dir",)),
    "audit-save-reference": (["audit", "--data", TASKS, "--save-reference", "OUT"], FILE_VICTIMS),
    "corpus": (["corpus", "--kind", "receipt", "--n", "1", "--out", "OUT"], DIR_VICTIMS),
    "corpus-train": (["corpus", "--kind", "train", "--n", "1", "--out", "OUT"], DIR_VICTIMS),
    "train-target": (["train-target", "--steps", "1", "--out", "OUT"], DIR_VICTIMS),
    "train-head": (["train-head", "--model", DEFAULT_MODEL, "--data", TASKS, "--steps", "1", "--out", "OUT"],
                   DIR_VICTIMS),
    "prepare-head-data": (["prepare-head-data", "--model", DEFAULT_MODEL, "--data", TASKS, "--out", "OUT"],
                          DIR_VICTIMS),
    "init-head": (["init-head", "--model", DEFAULT_MODEL, "--out", "OUT"], DIR_VICTIMS),
    "triton": (["triton", "--artifacts", DEFAULT_ARTIFACTS, "--out", "OUT"], DIR_VICTIMS),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_output_path_keeps_what_it_did_not_make(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(devices, "probe_device", lambda: BuildGpu("NVIDIA H100 80GB HBM3", "9.0", 79.6))
    template, victims = COMMANDS[command]

    def run(out: Path) -> tuple[int, str]:
        argv = [str(out) if a == "OUT" else str(out.parent / "engines") if a == "ENGINES" else str(a)
                for a in template]
        rc = cli.main(argv)
        return rc, capsys.readouterr().err

    assert_kept(run, tmp_path, victims)


def test_save_reference_refuses_its_own_inputs(tmp_path, capsys):
    """The task file, or the model's config.json, given as the reference to write: refused, unchanged."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(TASKS.read_text().replace('"image": "', f'"image": "{TASKS.parent}/'))
    before = tree(tmp_path)
    for target in (tasks, DEFAULT_MODEL / "config.json"):
        config = (DEFAULT_MODEL / "config.json").read_bytes()
        assert cli.main(["audit", "--data", str(tasks), "--save-reference", str(target)]) == 2
        err = capsys.readouterr().err
        assert "is the input" in err or "lies inside the input" in err, err
        assert tree(tmp_path) == before and (DEFAULT_MODEL / "config.json").read_bytes() == config
    assert json.loads(tasks.read_text().splitlines()[0])["prompt"]
