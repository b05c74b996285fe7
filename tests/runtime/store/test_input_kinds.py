"""A file that is something else is named as what it is: a symbolic link loop as a loop (not an unreadable or
missing file), and an optional file counts as absent only when nothing at all is at its path."""
from __future__ import annotations

import os
import re

import pytest

from glance_runtime.errors import GlanceError
from glance_runtime.store.input_files import open_regular, present, read_bytes, regular_file

pytestmark = pytest.mark.edge

FIX = "restore the file"


def test_a_symbolic_link_loop_is_named_a_loop(tmp_path):
    loop = tmp_path / "config.json"
    loop.symlink_to(loop.name)
    for call in (lambda: regular_file(loop, "head config", FIX), lambda: read_bytes(loop, "head config", FIX, 1 << 20),
                 lambda: open_regular(loop, "head config", FIX), lambda: present(loop, "head config", FIX)):
        with pytest.raises(GlanceError) as err:
            call()
        assert str(err.value) == f"head config {loop} is a symbolic link loop; {FIX}"


@pytest.mark.parametrize("shape, words", [("fifo", "a named pipe (FIFO)"), ("dir", "a directory"),
                                          ("dangling", "a dangling symbolic link")])
def test_an_optional_file_of_another_kind_is_named_not_taken_for_absent(tmp_path, shape, words):
    path = tmp_path / "generation_config.json"
    if shape == "fifo":
        os.mkfifo(path)
    elif shape == "dir":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "gone")
    with pytest.raises(GlanceError, match=re.escape(f"generation config {path} is {words}")):
        present(path, "generation config", FIX)


def test_an_optional_file_is_absent_only_when_nothing_is_there(tmp_path):
    path = tmp_path / "generation_config.json"
    assert present(path, "generation config", FIX) is False
    path.write_text("{}")
    assert present(path, "generation config", FIX) is True
    with open_regular(path, "generation config", FIX) as fh:
        assert fh.read() == b"{}"
