"""Outputs appear whole or not at all: built in a temporary sibling, renamed into place at the end.

Killed at any point (even SIGKILL, where no cleanup runs), a command leaves the previous output in
place or, for the instant between two renames, parked in a hidden sibling; the next run into the
same place restores a parked output and removes the half-built leftovers of processes that are gone.

Every output directory carries a marker naming the format and the command that made it, so a command
replaces only an output of its own format (or an empty directory) and never a model snapshot, a task
folder or a home directory that happens to be passed as `--out`; and no input is ever an output.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import GlanceError

MARKER = ".glance-output.json"  # {"format": ..., "made_by": ...}; hidden, so bundles and listings skip it

NEW, OLD = "new", "old"  # hidden siblings: .NAME.new.PID.* (being built), .NAME.old.PID.* (being replaced)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(out: Path) -> None:
    """Put back an output parked by a process killed mid-swap; delete dead processes' partial builds."""
    prefix = f".{out.name}."
    for sibling in sorted(out.parent.iterdir()) if out.parent.is_dir() else []:
        kind, _, rest = sibling.name[len(prefix):].partition(".")
        pid = rest.partition(".")[0]
        if not sibling.name.startswith(prefix) or kind not in (NEW, OLD) or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == OLD and not out.exists():
            os.replace(sibling, out)
        else:
            shutil.rmtree(sibling, ignore_errors=True)


def check_writable(out: str | Path) -> None:
    """Refuse, before any work, an output whose directory cannot be created or written."""
    out = Path(out).absolute()
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise GlanceError(f"cannot create {out}: {parent} is a file, not a directory; pick another output path")
    try:  # a real probe: permission bits say nothing for root, read-only mounts or /proc
        os.rmdir(tempfile.mkdtemp(prefix=".glance-probe.", dir=parent))
    except OSError as exc:
        raise GlanceError(f"cannot create {out}: {parent} is not writable ({exc.strerror}); "
                          "pick a writable output path") from None


def output_format(directory: Path) -> str | None:
    """The format in `directory`'s marker (None: no command made it, or the marker is unreadable)."""
    try:
        found = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return found.get("format") if isinstance(found, dict) and isinstance(found.get("format"), str) else None


def check_not_input(out: str | Path, inputs: Iterable[str | Path | None]) -> None:
    """Refuse an output that is an input, holds one, or lies inside one. Compared by real path, so a
    symlink or `..` does not hide that the output is an input."""
    real = Path(os.path.realpath(out))
    for given in inputs:
        if given is None:
            continue
        source = Path(os.path.realpath(given))
        if real == source:
            why = "is the input"
        elif source.is_relative_to(real):
            why = "holds the input"
        elif real.is_relative_to(source) and source.is_dir():
            why = "lies inside the input"
        else:
            continue
        raise GlanceError(f"output {out} {why} {given}, which writing it would change; pick an output path "
                          "outside every input")


def check_output(out: str | Path, fmt: str, inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse, before any work, an output this command may not replace: an input (or what holds one), a
    file, or a non-empty directory whose marker is not `fmt` (one no command made, or another kind)."""
    out = Path(out)
    check_not_input(out, inputs)
    if out.is_symlink() and not out.exists():
        raise GlanceError(f"output {out} is a dangling symbolic link; remove it or pick another output path")
    if out.exists():
        if not out.is_dir():
            raise GlanceError(f"output {out} exists and is not a directory; pick a new or empty directory")
        try:
            empty = not any(out.iterdir())
        except OSError as exc:
            raise GlanceError(f"cannot list output {out} ({exc.strerror}); pick a readable, writable "
                              "directory") from None
        found = output_format(out)
        if not empty and found != fmt:
            what = f"a {found} output" if found else "a directory no glance command made"
            raise GlanceError(f"output {out} is {what}, not a {fmt} output, and writing there would replace it; "
                              "pick a new or empty directory")
    check_writable(out)


def mark(directory: Path, fmt: str, made_by: str) -> None:
    """Write the marker that lets the next run of `made_by` (and only a writer of `fmt`) replace `directory`."""
    write_file(directory / MARKER, json.dumps({"format": fmt, "made_by": made_by}) + "\n")


def output_directory(out: str | Path, fmt: str, made_by: str, inputs: Iterable[str | Path | None] = ()) -> Path:
    """For writers that fill their directory file by file (task folders, reports, training runs): checked
    as `check_output`, created and marked before the first file, so a rerun may replace what a stopped one left."""
    out = Path(out)
    check_output(out, fmt, inputs)
    try:
        out.mkdir(parents=True, exist_ok=True)
        mark(out, fmt, made_by)
    except OSError as exc:
        raise GlanceError(f"cannot create {out} ({exc.strerror}); pick a writable output path") from None
    return out


def _fresh(out: Path, kind: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}.{os.getpid()}.", dir=out.parent))


@contextmanager
def atomic_directory(out: str | Path, fmt: str, made_by: str) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `out`, marked as `fmt` made by `made_by`; on success it
    replaces `out`, on any failure (including Ctrl-C) it is removed and `out` is left as it was.
    Writers call `check_output` (with their inputs) before their work; this checks the format again."""
    out = Path(out)
    check_output(out, fmt)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        recover(out)
        tmp = _fresh(out, NEW)
    except OSError as exc:
        raise GlanceError(f"cannot create {out} ({exc.strerror}); pick a writable output path") from None
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary directory
        yield tmp
        mark(tmp, fmt, made_by)
        if out.exists():
            parked = _fresh(out, OLD)
            os.replace(out, parked)  # onto the empty directory mkdtemp made: still one rename
            os.replace(tmp, out)
            shutil.rmtree(parked, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_file(path: str | Path, data: str | bytes) -> None:
    """One file, whole or not at all: written to a unique hidden sibling, flushed, renamed into place.
    OSError propagates (with the sibling removed), so each caller words its own refusal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_files(directory: str | Path) -> Iterator[Path]:
    """Yield a temporary directory inside `directory`; on success each file written there replaces its
    namesake in `directory` by one rename, so every file is seen (or left by a kill) whole, old or new."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / "files"
    recover(staging)
    tmp = _fresh(staging, NEW)
    try:
        yield tmp
        for path in sorted(tmp.iterdir()):
            os.replace(path, directory / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
