"""The one error type users see: a single line naming the problem and the fix, and the few failures of
the machine itself (a full disk, a closed or full stdout) worded the same way instead of a traceback."""
from __future__ import annotations

import errno
import os
import sys


class GlanceError(Exception):
    """Bad input or environment; the CLIs print it as one line and exit non-zero."""


_DISK = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exhausted",
         errno.EFBIG: "the file grew past the file system's limit", errno.EROFS: "the file system is read-only",
         errno.EIO: "an input/output error"}


def machine_failure(exc: OSError) -> GlanceError | None:
    """The one-line form of a write the machine refused (None: an OSError that is a bug, kept loud)."""
    if exc.errno == errno.EPIPE or isinstance(exc, BrokenPipeError):
        return GlanceError("the output was closed before the command finished (a pipe's reader exited); "
                           "keep the reader open, or write to a file")
    if exc.errno in _DISK:
        where = f" writing {exc.filename}" if exc.filename else ""
        return GlanceError(f"{_DISK[exc.errno]}{where}; free space (or pick another place to write) and run again")
    return None


def check_stdout() -> GlanceError | None:
    """A closed stdout (`cmd >&-`) is refused before any work: the answer and reports have nowhere to go."""
    if sys.stdout is None:
        return GlanceError("stdout is closed; run with stdout open, or redirect it to a file")
    return None


def silence_stdout() -> None:
    """After a failed write, point stdout at /dev/null so the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass
class InputError(GlanceError):
    """The caller's prompt, messages, images or flags cannot be served as given."""


class LimitError(GlanceError):
    """The request exceeds what the loaded graphs or buffers hold (context, tree size, top-k)."""


class IntegrityError(GlanceError):
    """Artifacts or engines on disk fail their checks (hashes, manifest, format version)."""
