"""Files a user names are typed and sized before a byte is read.

Opening a FIFO blocks until a writer appears, `/dev/zero` never ends, and a sparse file of a terabyte reads
as one: so a file is stat'ed first (a regular file, or one line naming what it is instead), opened without
blocking, checked again on the open descriptor (the name may have been swapped in between) and read no
further than the caller's limit.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from ..errors import GlanceError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(mode: int) -> str | None:
    """What a path's `st_mode` names when it is not a regular file, in words (None when it is one): such a
    path is refused by its mode, before it is opened."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "a special file")


def size_words(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"


def regular_file(path: str | Path, what: str, fix: str) -> os.stat_result:
    """The stat of `path` if it is a regular file (through symbolic links), else one GlanceError line."""
    path = Path(path)
    try:
        return _regular(path, os.stat(path), what, fix)
    except FileNotFoundError:
        if os.path.islink(path):
            raise GlanceError(f"{what} {path} is a dangling symbolic link (to {os.readlink(path)}); {fix}") from None
        raise GlanceError(f"{what} {path} does not exist; {fix}") from None
    except OSError as exc:
        raise _unreadable(path, exc, what, fix) from None


def present(path: str | Path, what: str, fix: str) -> bool:
    """Whether an optional file is there: False only when nothing at all is at `path`. Anything else that is
    not a regular file (a directory, a FIFO, a dangling link, a link loop) is refused in one line naming what it
    is, never taken for a missing file."""
    if not os.path.lexists(path):
        return False
    regular_file(path, what, fix)
    return True


def _unreadable(path: Path, exc: OSError, what: str, fix: str) -> GlanceError:
    if exc.errno == errno.ELOOP:
        return GlanceError(f"{what} {path} is a symbolic link loop; {fix}")
    return GlanceError(f"cannot read {what} {path} ({exc.strerror}); {fix}")


def _regular(path: Path, found: os.stat_result, what: str, fix: str) -> os.stat_result:
    words = not_regular(found.st_mode)
    if words is not None:
        words += ", not a file" if stat.S_ISDIR(found.st_mode) else ", not a regular file"
        raise GlanceError(f"{what} {path} is {words}; {fix}")
    return found


def open_regular(path: str | Path, what: str, fix: str) -> BinaryIO:
    """`path` opened for reading once it is known to be a regular file (checked by name, then again on the
    open descriptor), so that a reader which takes a file object (a pickle, an archive) never blocks on a FIFO."""
    path = Path(path)
    regular_file(path, what, fix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise _unreadable(path, exc, what, fix) from None
    try:
        _regular(path, os.fstat(fd), what, fix)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bytes(path: str | Path, what: str, fix: str, limit: int) -> bytes:
    """The whole file, refused in one line if it is not a regular file or holds more than `limit` bytes."""
    path = Path(path)
    with open_regular(path, what, fix) as fh:
        found = os.fstat(fh.fileno())
        if found.st_size > limit:
            raise GlanceError(f"{what} {path} holds {size_words(found.st_size)}, more than the {size_words(limit)} "
                              f"such a file may; {fix}")
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise GlanceError(f"cannot read {what} {path} ({exc.strerror}); {fix}") from None
    if len(data) > limit:  # grew while being read
        raise GlanceError(f"{what} {path} holds more than the {size_words(limit)} such a file may; {fix}")
    return data


def peek(path: str | Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of `path` if it is a regular file, else None: for files this toolkit may have
    written (journals, markers, headers), where anything else is simply not one of them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as fh:
        try:
            return fh.read(limit)
        except OSError:
            return None
