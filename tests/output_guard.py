"""The one check every command's output path goes through in the tests: whatever already lies at the
output (a user's file or folder, a model's config.json, another command's output), a command that did not
make it refuses in one line and leaves every byte around the output as it was."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

MARKER = ".glance-output.json"
DEAD_PID = 2 ** 22 + 1  # above Linux's largest process id: never a live process


def _user_file(path: Path) -> None:
    path.write_text("someone's notes\n")


def _config_json(path: Path) -> None:
    path.write_text(json.dumps({"model_type": "qwen2_5_vl", "hidden_size": 64}) + "\n")


def _other_format_file(path: Path) -> None:
    path.write_text(json.dumps({"format": "glance-some-other-format", "format_version": 1}) + "\n")


def _user_dir(path: Path) -> None:
    path.mkdir()
    (path / "keep.txt").write_text("someone's folder\n")


def _other_format_dir(path: Path) -> None:
    path.mkdir()
    (path / "weights.bin").write_bytes(b"\0\1")
    (path / MARKER).write_text(json.dumps({"format": "glance-some-other-format", "made_by": "elsewhere"}))


def _binary_file(path: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")


VICTIMS: dict[str, Callable[[Path], None]] = {
    "user-file": _user_file, "config-json": _config_json, "other-format-file": _other_format_file,
    "binary-file": _binary_file, "user-dir": _user_dir, "other-format-dir": _other_format_dir}


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`, hidden ones included: file bytes, a link's target, or "dir"."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            found[key] = f"link {os.readlink(path)}" if path.is_symlink() else \
                "dir" if path.is_dir() else path.read_bytes()
    return found


def lookalikes(out: Path) -> None:
    """Hidden siblings a user may own whose names look like a command's temporary names."""
    for name in (f".{out.name}.new.{DEAD_PID}.abc", f".{out.name}.old.{DEAD_PID}.abc", f".{out.name}.glance-{'0' * 32}.new",
                 f".{out.name}.glance-{'0' * 32}.old"):
        (out.parent / name).mkdir()
        (out.parent / name / "mine.txt").write_text("a user's file\n")
    (out.parent / f".{out.name}.glance-{'1' * 32}.json").write_text("not a journal\n")


def assert_kept(run: Callable[[Path], tuple[int, str]], root: Path, victims: tuple[str, ...] = tuple(VICTIMS),
                name: str = "out") -> None:
    """For each victim planted at `root/<victim>/<name>`: `run(out)` (exit code, stderr) refuses in one
    line that names the output, and nothing under that folder changes."""
    for victim in victims:
        out = root / victim / name
        out.parent.mkdir(parents=True)
        VICTIMS[victim](out)
        lookalikes(out)
        before = tree(out.parent)
        rc, err = run(out)
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc != 0, (victim, err)
        assert lines and "Traceback" not in err and str(out) in lines[-1], (victim, err)
        assert tree(out.parent) == before, victim
