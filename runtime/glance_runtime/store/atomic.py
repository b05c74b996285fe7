"""Outputs appear whole or not at all: built in a temporary sibling, renamed into place at the end.

Every replacement first writes a journal next to the output (`.NAME.glance-TOKEN-PID.json`, TOKEN 128
random bits, PID the writer's process id) naming its two siblings, `.NAME.glance-TOKEN-PID.new` (being
built) and `.NAME.glance-TOKEN-PID.old` (the output being replaced, for the instant between two renames).
Killed at any point (even SIGKILL, where no cleanup runs), a command leaves the previous output in place or
parked; the next run into the same place reads the journals of processes that are gone, puts a parked output
back and removes the half-built sibling. A process killed between creating its journal and writing it leaves
an empty file whose name alone says whose it was, so that goes too. Only what a journal names is ever moved or
deleted, so a user's file that merely looks like a temporary name is never touched.

Every output directory carries a marker naming the format, the command that made it and the entries it
wrote, and every output file starts with its format header (`{"format": ...`), so a command replaces only an
output of its own format (or an empty directory) and never a model snapshot, a task file or a home directory
that happens to be passed as an output; a directory replaced whole must hold nothing its maker did not write
(a user's notes, held-out data or images put there later), and no input is ever an output.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from contextlib import contextmanager
from glob import escape
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import GlanceError
from .input_files import peek

MARKER = ".glance-output.json"  # {"format", "made_by", "entries"}; hidden, so bundles and listings skip it
MARKER_BYTES = 16 << 20  # a marker lists a directory's entries: thousands of shards at most
# Files the runtime keeps beside an output it reads (a device's measured costs, a calibration): they describe
# that output, so replacing it drops them with it.
COMPANION_FORMATS = ("glance-cost", "glance-calibration")

SWAP_FORMAT = "glance-swap"  # the journal of one replacement
HEADER_BYTES = 4096  # an output file's format header lies in its first bytes
_HEADER = re.compile(rb'\s*\{\s*"format"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


class _Swap:
    """The siblings of one replacement of `out`, named by the journal written before either exists."""

    def __init__(self, out: Path, token: str, pid: int | None):
        # Journals from before the writer's pid was in the name (pid None) are still read and settled.
        stem = out.parent / (f".{out.name}.glance-{token}" + (f"-{pid}" if pid is not None else ""))
        self.out, self.token = out, token
        self.journal, self.new, self.old = (Path(f"{stem}{suffix}") for suffix in (".json", ".new", ".old"))

    @classmethod
    def begin(cls, out: Path) -> "_Swap":
        swap = cls(out, secrets.token_hex(16), os.getpid())
        body = json.dumps({"format": SWAP_FORMAT, "pid": os.getpid(), "token": swap.token, "output": out.name})
        fd = os.open(swap.journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(body + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.mkdir(swap.new)
        return swap

    @classmethod
    def found(cls, journal: Path) -> tuple["_Swap", int] | None:
        """The swap a journal records, with its process id (None: not a journal of ours for this output)."""
        head = peek(journal, HEADER_BYTES)  # a FIFO or a huge file under a journal's name is not one
        try:
            raw = json.loads(head) if head is not None else None
        except ValueError:
            return None
        if not isinstance(raw, dict) or raw.get("format") != SWAP_FORMAT or type(raw.get("pid")) is not int:
            return None
        out, token = journal.parent / str(raw.get("output")), raw.get("token")
        if not isinstance(token, str) or not re.fullmatch(r"[0-9a-f]{32}", token):
            return None
        for swap in (cls(out, token, raw["pid"]), cls(out, token, None)):
            if swap.journal == journal:
                return swap, raw["pid"]
        return None

    @staticmethod
    def unwritten(journal: Path, out: Path) -> int | None:
        """The pid in the name of an empty journal of `out` (its writer killed before writing it; nothing
        else of the swap exists yet), or None for any other file."""
        named = re.fullmatch(rf"\.{re.escape(out.name)}\.glance-[0-9a-f]{{32}}-([0-9]{{1,10}})\.json", journal.name)
        try:
            found = journal.lstat()
        except OSError:
            return None
        return int(named.group(1)) if named and stat.S_ISREG(found.st_mode) and found.st_size == 0 else None

    def settle(self) -> None:
        """Finish or undo: the parked output goes back where the output is missing, then both siblings and
        the journal go. A sibling that is a symbolic link was not made here and is left alone."""
        if _real_dir(self.old) and not os.path.lexists(self.out):
            os.replace(self.old, self.out)
        for sibling in (self.new, self.old):
            if _real_dir(sibling):
                shutil.rmtree(sibling, ignore_errors=True)
        self.journal.unlink(missing_ok=True)


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def recover(out: Path) -> None:
    """Put back an output parked by a process killed mid-swap; delete dead processes' partial builds."""
    if not out.parent.is_dir():
        return
    for journal in sorted(out.parent.glob(f".{escape(out.name)}.glance-*.json")):
        found = _Swap.found(journal)
        if found is not None and found[0].out == out and not _alive(found[1]):
            found[0].settle()
        elif found is None and (pid := _Swap.unwritten(journal, out)) is not None and not _alive(pid):
            journal.unlink(missing_ok=True)


def check_writable(out: str | Path) -> None:
    """Refuse, before any work, an output whose directory cannot be created or written (an existing output
    directory too: what it holds is written or deleted in it)."""
    out = Path(out).absolute()
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise GlanceError(f"cannot create {out}: {parent} is a file, not a directory; pick another output path")
    for place in (parent, out) if out.is_dir() else (parent,):
        try:  # a real probe: permission bits say nothing for root, read-only mounts or /proc
            os.rmdir(tempfile.mkdtemp(prefix=".glance-probe.", dir=place))
        except OSError as exc:
            raise GlanceError(f"cannot {'write' if place == out else 'create'} {out}: {place} is not writable "
                              f"({exc.strerror}); pick a writable output path") from None


def _marker(directory: Path) -> dict | None:
    body = peek(directory / MARKER, MARKER_BYTES)
    try:
        found = json.loads(body) if body is not None else None
    except ValueError:
        return None
    return found if isinstance(found, dict) and isinstance(found.get("format"), str) else None


def output_format(directory: Path) -> str | None:
    """The format in `directory`'s marker (None: no command made it, or the marker is unreadable)."""
    found = _marker(directory)
    return found["format"] if found is not None else None


def file_format(path: Path) -> str | None:
    """The format an output file of this toolkit names first (None: any other file, or unreadable)."""
    head = peek(path, HEADER_BYTES)
    found = _HEADER.match(head) if head is not None else None
    return found.group(1).decode() if found else None


def _companion(path: Path) -> bool:
    """A file the runtime keeps beside an output (or an empty lock of one), or an output a glance command
    made inside this one (engines built in their bundle): they go with the output."""
    try:
        found = path.lstat()
    except OSError:
        return False
    if stat.S_ISDIR(found.st_mode):
        return output_format(path) is not None
    if not stat.S_ISREG(found.st_mode):
        return False
    if path.name.startswith(".") and path.name.endswith(".lock") and found.st_size == 0:
        return True
    return file_format(path) in COMPANION_FORMATS


def foreign_entries(directory: Path) -> list[str]:
    """What replacing `directory` whole would delete that its maker did not write. The marker lists what its
    maker wrote; a marker from before it did so is older than anything added since."""
    marker = _marker(directory)
    names = sorted(name for name in os.listdir(directory) if name != MARKER)
    made = marker.get("entries") if marker is not None else None
    if isinstance(made, list):
        ours = {name for name in made if isinstance(name, str)}
    else:
        try:
            since = (directory / MARKER).lstat().st_mtime
        except OSError:
            since = float("-inf")
        ours = {name for name in names if (directory / name).lstat().st_mtime <= since}
    return [name for name in names if name not in ours and not _companion(directory / name)]


def _check_no_foreign(out: Path, fix: str) -> None:
    try:
        found = foreign_entries(out)
    except OSError as exc:
        raise GlanceError(f"cannot list output {out} ({exc.strerror}); pick a readable, writable directory") from None
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        them = "it" if len(found) == 1 else "them"
        raise GlanceError(f"output {out} holds {shown}, which no glance command wrote there, and replacing the "
                          f"directory would delete {them}; move {them} out of {out} {fix}")


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


def _check_not_dangling(out: Path) -> None:
    if out.is_symlink() and not out.exists():
        raise GlanceError(f"output {out} is a dangling symbolic link; remove it or pick another output path")


def check_output(out: str | Path, fmt: str, inputs: Iterable[str | Path | None] = (), whole: bool = True) -> None:
    """Refuse, before any work, an output this command may not replace: an input (or what holds one), a
    file, a non-empty directory whose marker is not `fmt` (one no command made, or another kind), or, for
    a directory replaced `whole`, one holding anything its maker did not write."""
    out = Path(out)
    check_not_input(out, inputs)
    _check_not_dangling(out)
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
        if whole and not empty:
            _check_no_foreign(out, "or pick another output path")
    check_writable(out)


def check_output_file(out: str | Path, fmt: str, inputs: Iterable[str | Path | None] = (),
                      recognise: Callable[[Path], bool] | None = None) -> None:
    """Refuse, before any work, a file output this command may not replace: an input (or what holds one), a
    directory, or an existing file that does not start with `fmt`'s header (`recognise(path)` instead
    says whether a file is one of ours, for formats without a JSON header)."""
    out = Path(out)
    check_not_input(out, inputs)
    _check_not_dangling(out)
    if out.is_dir():
        raise GlanceError(f"output {out} is a directory, not a file; give a file name (in it, or elsewhere)")
    if out.exists():
        ours = recognise(out) if recognise is not None else file_format(out) == fmt
        if not out.is_file() or not ours:
            found = file_format(out) if out.is_file() else None
            what = f"a {found} file" if found else "a file no glance command wrote"
            raise GlanceError(f"output {out} is {what}, not a {fmt} file, and writing there would replace it; "
                              "pick a new file name (or remove the file yourself)")
    check_writable(out)


def mark(directory: Path, fmt: str, made_by: str, entries: Iterable[str] | None = None) -> None:
    """Write the marker that lets the next run of `made_by` (and only a writer of `fmt`) replace `directory`,
    listing the `entries` it wrote where it replaces the directory whole."""
    body: dict = {"format": fmt, "made_by": made_by}
    if entries is not None:
        body["entries"] = sorted(entries)
    write_file(directory / MARKER, json.dumps(body) + "\n")


def output_directory(out: str | Path, fmt: str, made_by: str, inputs: Iterable[str | Path | None] = ()) -> Path:
    """For writers that fill their directory file by file (task folders, reports, training runs): checked
    as `check_output`, created and marked before the first file, so a rerun may replace what a stopped one left."""
    out = Path(out)
    check_output(out, fmt, inputs, whole=False)
    try:
        out.mkdir(parents=True, exist_ok=True)
        mark(out, fmt, made_by)
    except OSError as exc:
        raise GlanceError(f"cannot create {out} ({exc.strerror}); pick a writable output path") from None
    return out


def _begin(out: Path) -> _Swap:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        recover(out)
        return _Swap.begin(out)
    except OSError as exc:
        raise GlanceError(f"cannot create {out} ({exc.strerror}); pick a writable output path") from None


@contextmanager
def atomic_directory(out: str | Path, fmt: str, made_by: str) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `out`, marked as `fmt` made by `made_by`; on success it
    replaces `out`, on any failure (including Ctrl-C) it is removed and `out` is left as it was.
    Writers call `check_output` (with their inputs) before their work; this checks the format again."""
    out = Path(out)
    if out.is_symlink():  # a link to an output directory: that directory is replaced, the link stays
        out = Path(os.path.realpath(out))
    check_output(out, fmt)
    swap = _begin(out)
    try:
        yield swap.new
        _ordinary_modes(swap.new)
        mark(swap.new, fmt, made_by, os.listdir(swap.new))
        if out.exists():
            _check_no_foreign(out, "and run the same command again")  # something may have arrived meanwhile
            os.mkdir(swap.old)
            os.replace(out, swap.old)  # onto the empty directory: still one rename
        os.replace(swap.new, out)
    finally:
        swap.settle()


def _ordinary_modes(directory: Path) -> None:
    """Give every file written into `directory` the read bits the umask allows, as a file created the ordinary way
    gets: a library that writes through a private temporary file (safetensors does, 0600) would leave head weights
    unreadable to the group and others beside 0644 neighbours. Bits are only added, and a file linked from
    elsewhere (another name for an input) is left as it is."""
    allowed = 0o666 & ~_umask()
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            found = os.lstat(path)
            if stat.S_ISREG(found.st_mode) and found.st_nlink == 1 and ~found.st_mode & allowed:
                os.chmod(path, stat.S_IMODE(found.st_mode) | allowed)


def write_file(path: str | Path, data: str | bytes) -> None:
    """One file, whole or not at all: written to a unique hidden sibling, flushed, renamed into place.
    OSError propagates (with the sibling removed), so each caller words its own refusal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.glance-", suffix=".tmp", dir=path.parent)
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
    swap = _begin(directory / "files")
    try:
        yield swap.new
        for path in sorted(swap.new.iterdir()):
            os.replace(path, directory / path.name)
    finally:
        swap.settle()
