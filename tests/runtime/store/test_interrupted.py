"""Interrupted work: real `glance-export` processes killed (SIGKILL, or Ctrl-C) at several points leave
the previous output exactly as it was, or nothing; the next run succeeds and leaves no debris; training
continues from its last checkpoint, and a resumed head run ends bit-identical to an uninterrupted one."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from glance_runtime.store.atomic import MARKER
import pytest
from safetensors.torch import load_file

from glance_export.model.adapters import Snapshot
from glance_export.cli import main as export_main
from glance_export.model.head import load_head
from glance_export.onnx import export_artifacts
from glance_export.train.checkpoint import STATE_FILE
from glance_runtime.formats import engines as engines_format
from glance_runtime.store.integrity import verify_engines
from glance_runtime.formats.artifacts import read as load_manifest
from support import TENSORRT_RTX_MISSING

pytestmark = pytest.mark.slow  # each test runs real exports, builds or training and kills them

CLI = "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"
TRAIN_TARGET = """import sys
from pathlib import Path
from glance_export.train.target import train_target
train_target(Path(sys.argv[1]), steps=int(sys.argv[2]), batch_size=2, vision_warmup=1, log_every=1, ckpt_every=1,
             eval_every=0, hidden=48, layers=1, vision_hidden=32, vision_depth=1)
"""
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
JOURNAL = re.compile(r"\..+\.glance-[0-9a-f]{32}-[0-9]+\.json")  # a swap's journal (store.atomic)


def _ctrl_c_deliverable() -> None:
    """A test run started in the background (`nohup`, `cmd &` in a script) has SIGINT ignored, which its
    children would inherit; Ctrl-C is what these tests press, so the child starts with it deliverable."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(argv: list[str], marker: str, sig: int = signal.SIGKILL, code: str = CLI) -> tuple[int, str]:
    """Start a real process, send `sig` as soon as it prints a line containing `marker`; (exit code, output)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV, preexec_fn=_ctrl_c_deliverable)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            proc.send_signal(sig)
            break
    rest, _ = proc.communicate(timeout=300)
    output = "".join(seen) + rest
    assert marker in output, f"never printed {marker!r}:\n{output}"
    return proc.returncode, output


def debris(out: Path) -> list[str]:
    """Hidden siblings a run leaves next to its output (temporary builds, parked old copies)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def snapshot_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def sources(snapshot_dir, tmp_path_factory) -> tuple[Path, Path]:
    head = tmp_path_factory.mktemp("interrupted") / "head"
    model = snapshot_dir("qwen2_5_vl")
    assert export_main(["init-head", "--model", str(model), "--out", str(head), "--block-size", "4"]) == 0
    return model, head


def test_killed_onnx_export_leaves_the_previous_export(sources, tmp_path):
    model, head = sources
    out = tmp_path / "art"
    argv = ["onnx", "--model", model, "--head", head, "--out", out, "--max-tree", "16", "--max-context", "128"]
    rc, _ = interrupt(argv, "exported target.onnx")  # the first export, killed: nothing appears
    assert rc == -signal.SIGKILL and not out.exists()
    export_artifacts(model, head, out, max_tree=16, max_context=128, progress=lambda _: None)
    before = snapshot_bytes(out)
    for marker, sig in [("loaded", signal.SIGKILL), ("exported vocab.onnx", signal.SIGKILL),
                        ("validated draft.onnx", signal.SIGINT), ("copied", signal.SIGKILL)]:
        rc, output = interrupt(argv, marker, sig)
        assert rc == (130 if sig == signal.SIGINT else -signal.SIGKILL), output
        if sig == signal.SIGINT:
            assert "interrupted" in output and "Traceback" not in output
        assert snapshot_bytes(out) == before
        load_manifest(out)
    assert debris(out)  # SIGKILL skips all cleanup: its half-built directory is still there...
    assert export_main([str(a) for a in argv] + ["--quiet"]) == 0
    assert debris(out) == []  # ...until the next run into the same place removes it
    load_manifest(out)


def test_killed_build_leaves_the_previous_engines(sources, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason=TENSORRT_RTX_MISSING)
    model, head = sources
    art = export_artifacts(model, head, tmp_path / "art", max_tree=16, max_context=128, progress=lambda _: None)
    out = tmp_path / "engines"
    argv = ["build", "--target", "rtx", "--artifacts", art, "--out", out]
    assert export_main([str(a) for a in argv]) == 0
    before = snapshot_bytes(out)
    for marker, sig in [("building", signal.SIGINT), ("built target engine", signal.SIGKILL),
                        ("built draft engine", signal.SIGKILL)]:
        rc, output = interrupt(argv, marker, sig)
        assert rc == (130 if sig == signal.SIGINT else -signal.SIGKILL), output
        assert snapshot_bytes(out) == before
    assert debris(out)
    assert export_main([str(a) for a in argv]) == 0
    assert debris(out) == []
    verify_engines(out, engines_format.read(out).files)


def test_killed_head_training_resumes_to_the_same_head(sources, images, tmp_path):
    model, _ = sources
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"image": "%s", "prompt": "What is shown?"}\n{"prompt": "Describe nothing."}\n' % images["wide"])
    argv = ["train-head", "--model", model, "--data", tasks, "--block-size", "4", "--steps", "6", "--batch", "2",
            "--anchors", "4", "--max-new-tokens", "12", "--checkpoint-every", "2", "--threads", "1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert export_main([str(a) for a in argv] + ["--out", str(whole)]) == 0
    assert not (whole / STATE_FILE).exists()  # a finished head is a plain head

    rc, _ = interrupt(argv + ["--out", resumed], "checkpoint at step 4")
    assert rc == -signal.SIGKILL and (resumed / STATE_FILE).is_file()
    load_head(resumed)  # the checkpoint is a loadable head
    before = snapshot_bytes(resumed)
    interrupt(argv + ["--out", resumed], "stage 1/2")  # killed again before training: checkpoint untouched
    assert snapshot_bytes(resumed) == before

    rc = export_main([str(a) for a in argv] + ["--out", str(resumed)])
    assert rc == 0 and not (resumed / STATE_FILE).exists() and debris(resumed) == []
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_killed_target_training_resumes_from_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    rc, output = interrupt([run, 6], "step 3/6", code=TRAIN_TARGET)
    assert rc == -signal.SIGKILL and (run / "checkpoint.pt").is_file()
    rc, output = interrupt([run, 6], "step 5/6", code=TRAIN_TARGET)
    assert rc == -signal.SIGKILL and int(output.split("resumed at step ")[1].split()[0]) >= 2
    done = subprocess.run([sys.executable, "-c", TRAIN_TARGET, str(run), "6"], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert done.returncode == 0 and "resumed at step" in done.stdout, done.stderr
    assert not [p for p in run.iterdir() if p.name.startswith(".") and p.name != MARKER]
    first = snapshot_bytes(run)
    rc, _ = interrupt([run, 8], "step 7/8", code=TRAIN_TARGET)  # a longer run killed: the snapshot stays whole
    assert rc == -signal.SIGKILL
    after = snapshot_bytes(run)
    kept = lambda files: {k: v for k, v in files.items()  # noqa: E731
                          if k != "checkpoint.pt" and not JOURNAL.fullmatch(Path(k).name)}
    assert kept(after) == kept(first)  # a swap's journal may stay, for the next run to undo
    Snapshot(run).load_model()
