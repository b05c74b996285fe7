"""Concurrent use: two `glance-run` processes started together on a cold export cache export once
(the second waits on the entry's lock, then reuses it) and both give the greedy answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from glance_export.cli import main as export_main
from glance_runtime.cli.run import main as run_main

RUN = "import sys; from glance_runtime.cli.run import main; sys.exit(main(sys.argv[1:]))"


def test_two_cold_starts_export_once_and_both_answer(snapshot_dir, images, tmp_path, capsys):
    model, head = snapshot_dir("qwen2_5_vl"), tmp_path / "head"
    assert export_main(["init-head", "--model", str(model), "--out", str(head), "--block-size", "4"]) == 0
    capsys.readouterr()
    question = ["--image", str(images["wide"]), "--prompt", "What is shown?", "--max-new-tokens", "12", "--json"]
    assert run_main(["--backend", "torch", "--model", str(model), "--no-spec", *question]) == 0
    greedy = json.loads(capsys.readouterr().out)["token_ids"]

    env = {**os.environ, "GLANCE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", RUN, "--backend", "onnxruntime", "--model", str(model), "--head", str(head),
            "--threads", "1", *question]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    assert sum("exporting" in err for _, err in results) == 1
    assert [json.loads(out)["token_ids"] for out, _ in results] == [greedy, greedy]
    entries = [p for p in (tmp_path / "cache" / "onnx").iterdir() if p.is_dir()]
    assert len(entries) == 1 and not [p for p in entries[0].parent.iterdir() if p.name.startswith(".")]
