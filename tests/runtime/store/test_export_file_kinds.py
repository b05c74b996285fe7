"""An export's files are typed before they are hashed or opened: a manifest, graph or runtime file that is a
directory, a FIFO or a symbolic link loop is named as what it is (not as missing) and never blocks `gr.load` or
`glance-run`. Each case runs in a child with a deadline, so a regression fails instead of hanging."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import GLANCE_RUN, KIND_WORDS, copy_with, export_once, one_line_refusal

CHILD_TIMEOUT_S = 120
CASES = [(name, shape) for name in ("manifest.json", "target.onnx", "draft.onnx", "tokenizer.json")
         for shape in KIND_WORDS]
LOAD_IN_CHILD = ("import sys, glance_runtime as gr\n"
                 "try:\n    gr.load(sys.argv[1])\n"
                 "except gr.GlanceError as exc:\n    sys.exit(print(exc, file=sys.stderr) or 1)\n")


@pytest.fixture(scope="module")
def export(snapshot_dir, tmp_path_factory) -> Path:
    return export_once(snapshot_dir, tmp_path_factory, "qwen3")[2]


@pytest.mark.parametrize("name, shape", CASES)
def test_an_exported_file_of_another_kind_is_named_and_never_blocks(export, tmp_path, name, shape):
    artifacts = copy_with(export, tmp_path / "art", name, shape)
    run = subprocess.run([sys.executable, "-c", LOAD_IN_CHILD, str(artifacts)], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    one_line_refusal(run, f"{artifacts / name} {KIND_WORDS[shape]}")


@pytest.mark.parametrize("name", ["manifest.json", "draft.onnx"])
def test_glance_run_names_a_fifo_in_the_export(export, tmp_path, name):
    artifacts = copy_with(export, tmp_path / "art", name, "fifo")
    run = subprocess.run([*GLANCE_RUN, "--artifacts", str(artifacts), "--prompt", "Hello", "--max-new-tokens", "4"],
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    one_line_refusal(run, f"{artifacts / name} is a named pipe (FIFO)")


GLANCE_EXPORT = [sys.executable, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"]


@pytest.mark.parametrize("name", ["manifest.json", "target.onnx"])
def test_glance_export_build_names_a_fifo_in_the_export(export, tmp_path, name):
    artifacts = copy_with(export, tmp_path / "art", name, "fifo")
    run = subprocess.run([*GLANCE_EXPORT, "build", "--target", "rtx", "--artifacts", str(artifacts), "--out",
                          str(tmp_path / "engines"), "--plan-only"],
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    one_line_refusal(run, f"{artifacts / name} is a named pipe (FIFO)")
