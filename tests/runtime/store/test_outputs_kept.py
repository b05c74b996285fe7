"""Every output path of the runtime's commands keeps what it did not make: a user's file or folder, a
model's config, another command's output, and hidden siblings that look like temporary names. Each
command is run for real, in process; it refuses in one line before any work."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from glance_runtime.cli.bench import main as bench_main
from glance_runtime.store.atomic import atomic_directory, recover, write_file
from support import assert_kept, lookalikes, tree

pytestmark = pytest.mark.edge

REPO = Path(__file__).resolve().parents[3]
TASKS = REPO / "examples" / "receipt" / "tasks.jsonl"
FILE_VICTIMS = ("user-file", "config-json", "other-format-file", "binary-file")


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    rc = bench_main(argv)
    return rc, capsys.readouterr().err


@pytest.fixture
def rounds(tmp_path) -> Path:
    path = tmp_path / "inputs" / "rounds.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"mode": "tree-7", "entropy": 0.5, "accepted": 1}) + "\n")
    return path


def test_glance_bench_out(tmp_path, capsys):
    assert_kept(lambda out: _run(capsys, ["--data", str(TASKS), "--out", str(out)]), tmp_path / "victims",
                ("user-file", "user-dir", "other-format-dir"))


def test_glance_bench_law_out(tmp_path, capsys, rounds):
    assert_kept(lambda out: _run(capsys, ["law", str(rounds), "--out", str(out)]), tmp_path / "victims",
                ("user-file", "user-dir", "other-format-dir"))


def test_glance_bench_calibrate_out(tmp_path, capsys, rounds):
    assert_kept(lambda out: _run(capsys, ["calibrate", str(rounds), "--out", str(out)]), tmp_path / "victims",
                FILE_VICTIMS, name="calibration.json")
    before = tree(rounds.parent)
    rc, err = _run(capsys, ["calibrate", str(rounds), "--out", str(rounds)])
    assert rc == 2 and "is the input" in err and tree(rounds.parent) == before


def test_a_replaced_directory_leaves_look_alike_siblings_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lookalikes(out)
    siblings = {k: v for k, v in tree(tmp_path).items() if not k.startswith("out")}
    for text in ("first", "second"):
        with atomic_directory(out, "fmt-a", "glance-test") as tmp:
            (tmp / "data.txt").write_text(text)
    assert (out / "data.txt").read_text() == "second"
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("out")} == siblings


def test_a_killed_swap_is_undone_from_its_journal_only(tmp_path):
    """A journal left by a process that is gone: its parked output goes back, its partial build goes; a
    look-alike sibling without a journal stays."""
    out = tmp_path / "out"
    with atomic_directory(out, "fmt-a", "glance-test") as tmp:
        (tmp / "data.txt").write_text("kept")
    token = "ab" * 16
    journal = tmp_path / f".out.glance-{token}.json"
    write_file(journal, json.dumps({"format": "glance-swap", "pid": 2 ** 22 + 1, "token": token, "output": "out"}))
    (tmp_path / f".out.glance-{token}.new").mkdir()
    (tmp_path / f".out.glance-{token}.new" / "half.bin").write_bytes(b"\0")
    out.rename(tmp_path / f".out.glance-{token}.old")  # killed between the two renames
    lookalikes(out)
    siblings = {k: v for k, v in tree(tmp_path).items() if ".glance-" + token not in k and not k.startswith("out")}
    recover(out)
    assert (out / "data.txt").read_text() == "kept"
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("out")} == siblings


def test_a_journal_its_writer_never_wrote_goes_with_the_next_run(tmp_path):
    """A process killed between creating its journal and writing it leaves an empty file: the pid in its name
    says its writer is gone, so the next run removes it. An empty one of a live process, and empty look-alikes
    without a pid in the name, stay."""
    out = tmp_path / "out"
    token = "cd" * 16
    killed = subprocess.run([sys.executable, "-c", f"""if True:
        import os, signal
        os.close(os.open(f".out.glance-{token}-{{os.getpid()}}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.kill(os.getpid(), signal.SIGKILL)"""], cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL
    (unwritten,) = tmp_path.glob(f".out.glance-{token}-*.json")
    assert unwritten.stat().st_size == 0
    live = tmp_path / f".out.glance-{'ef' * 16}-{os.getpid()}.json"
    live.touch()
    lookalikes(out)
    (tmp_path / f".out.glance-{'2' * 32}.json").touch()
    siblings = {k: v for k, v in tree(tmp_path).items() if k != unwritten.name}
    with atomic_directory(out, "fmt-a", "glance-test") as tmp:
        (tmp / "data.txt").write_text("new")
    assert not unwritten.exists() and live.exists()
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("out")} == siblings
