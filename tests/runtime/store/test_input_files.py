"""Files are typed and sized before they are read: a FIFO, a device, a directory, a dangling link or a file
over its limit is named in one line, and nothing blocks or reads without end. Journals and markers under
those shapes are simply not ours."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from glance_runtime.errors import GlanceError
from glance_runtime.store.atomic import MARKER, output_format, recover
from glance_runtime.store.input_files import peek, read_bytes, regular_file

pytestmark = pytest.mark.edge

FIX = "pass another file"


@pytest.mark.parametrize("shape, words", [("fifo", "FIFO"), ("device", "character device"), ("dir", "directory"),
                                          ("dangling", "dangling symbolic link"), ("missing", "does not exist")])
def test_what_is_not_a_regular_file_is_named(tmp_path, shape, words):
    path = tmp_path / "data.jsonl"
    if shape == "fifo":
        os.mkfifo(path)
    elif shape == "device":
        path = "/dev/zero"
    elif shape == "dir":
        path.mkdir()
    elif shape == "dangling":
        path.symlink_to(tmp_path / "gone")
    for call in (lambda: regular_file(path, "data file", FIX), lambda: read_bytes(path, "data file", FIX, 1 << 20)):
        with pytest.raises(GlanceError, match=f"{words}.*{FIX}"):
            call()
    assert peek(path, 16) is None


def test_a_file_over_its_limit_is_refused_by_its_size_not_read(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as fh:
        fh.truncate(8 << 30)  # sparse: 8 GiB that take no room
    with pytest.raises(GlanceError, match="8 GiB, more than the 1 MiB"):
        read_bytes(path, "data file", FIX, 1 << 20)
    assert peek(path, 16) == b"\0" * 16


def _in_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run in a child with a deadline: a blocked open would otherwise hang the test run."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_fifo_or_huge_file_named_like_a_journal_or_marker_neither_blocks_nor_is_read(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(tmp_path / f".out.glance-{'a' * 32}.json")
    with open(tmp_path / f".out.glance-{'b' * 32}.json", "wb") as fh:
        fh.truncate(1 << 30)
    os.mkfifo(out / MARKER)
    done = _in_child(f"""
        from pathlib import Path
        from glance_runtime.store.atomic import output_format, recover
        recover(Path({str(out)!r}))
        assert output_format(Path({str(out)!r})) is None
        print(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
    """)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 300 * 1024  # peak KiB of this process image (ru_maxrss counts the forked parent)
    assert (tmp_path / f".out.glance-{'a' * 32}.json").exists()  # not ours: left alone
    assert output_format(tmp_path) is None and recover(out) is None


def test_a_journal_that_is_ours_is_still_read(tmp_path):
    out = tmp_path / "out"
    token = "c" * 32
    (tmp_path / f".out.glance-{token}.new").mkdir()
    (tmp_path / f".out.glance-{token}.json").write_text(
        json.dumps({"format": "glance-swap", "pid": 2 ** 22 + 1, "token": token, "output": "out"}))
    recover(out)
    assert list(tmp_path.iterdir()) == []


def test_a_task_file_that_is_a_fifo_is_named_as_one(tmp_path):
    from glance_runtime.formats.tasks import read as read_tasks

    os.mkfifo(tmp_path / "tasks.jsonl")
    with pytest.raises(GlanceError, match=r"tasks.jsonl is a named pipe \(FIFO\)"):
        read_tasks(tmp_path / "tasks.jsonl")
