"""A model snapshot's files are typed before anything reads them: a config, tokenizer, generation config or
weights file that is a directory, a FIFO or a symbolic link loop is named as what it is (not as missing, not a
traceback) and never blocks the load. Each load runs under a deadline, so a regression fails instead of hanging."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import glance_runtime as gr
from glance_runtime.errors import GlanceError
from support import GLANCE_RUN, KIND_WORDS, copy_with, one_line_refusal, within

FAMILY = "qwen3"
CHILD_TIMEOUT_S = 120
CASES = [(name, shape) for name in ("config.json", "tokenizer.json", "generation_config.json", "model.safetensors")
         for shape in KIND_WORDS]


@pytest.mark.parametrize("name, shape", CASES)
def test_a_snapshot_file_of_another_kind_is_named_and_never_blocks(snapshot_dir, tmp_path, name, shape):
    model = copy_with(Path(snapshot_dir(FAMILY)), tmp_path / "model", name, shape)
    with pytest.raises(GlanceError) as refused:
        within(CHILD_TIMEOUT_S, lambda: gr.load(model=model, backend="torch", speculative=False))
    message = str(refused.value)
    assert f"{model / name} {KIND_WORDS[shape]}" in message and "\n" not in message


@pytest.mark.parametrize("name", ["config.json", pytest.param("tokenizer.json", marks=pytest.mark.slow)])
def test_glance_run_names_a_fifo_in_the_snapshot(snapshot_dir, tmp_path, name):
    model = copy_with(Path(snapshot_dir(FAMILY)), tmp_path / "model", name, "fifo")
    run = subprocess.run([*GLANCE_RUN, "--backend", "torch", "--model", str(model), "--prompt", "Hello",
                          "--max-new-tokens", "4", "--no-spec"],
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    one_line_refusal(run, f"{model / name} is a named pipe (FIFO)")
