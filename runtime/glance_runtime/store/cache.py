"""Where the runtime keeps what it can rebuild (exports, hash stamps, cost profiles), and the lock that lets
several processes share it: the first one builds an entry, the others wait and reuse it.

The location is resolved and checked once per environment: a directory that exists or can be made and
that this process can write, or a one-line refusal naming the variable it came from and how to fix it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from ..errors import GlanceError

FIX = "set GLANCE_CACHE to a writable directory"


def cache_root() -> Path:
    """`$GLANCE_CACHE`, else ~/.cache/glance; an empty GLANCE_CACHE counts as unset (never the current directory)."""
    env, home = os.environ.get("GLANCE_CACHE") or None, os.environ.get("HOME") or None
    here = os.getcwd() if any(v and not v.startswith(("/", "~")) for v in (env, home)) else None
    return _checked(env, home, here)  # a relative value is checked once per working directory


def _refuse(root: Path, source: str, why: str) -> GlanceError:
    return GlanceError(f"cache directory {root} ({source}) {why}; {FIX}"
                       + (" or unset it for ~/.cache/glance" if source.startswith("$GLANCE_CACHE") else ""))


@lru_cache(maxsize=8)
def _checked(env: str | None, home: str | None, here: str | None) -> Path:
    if env is not None:
        try:
            root, source = Path(env).expanduser(), "$GLANCE_CACHE"
        except RuntimeError:  # ~name of no such user
            raise GlanceError(f"cache directory {env} ($GLANCE_CACHE) names an unknown user's home; {FIX}") from None
    elif home is not None:
        root, source = Path(home) / ".cache" / "glance", "under $HOME"
    else:
        try:
            root, source = Path.home() / ".cache" / "glance", "under the home directory"
        except RuntimeError:
            raise GlanceError(f"no home directory to keep the cache in (HOME is unset); {FIX}") from None
    root = Path(here or os.getcwd()) / root if not root.is_absolute() else root
    try:
        above = next((p for p in [root, *root.parents] if p.exists() or p.is_symlink()), None)
        if above is not None and not above.is_dir():
            where = "is a file" if above == root else f"lies under {above}, which is not a directory"
            raise _refuse(root, source, where)
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".glance-probe.", dir=root)  # permission bits say nothing for root
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = ("is on a read-only file system" if exc.errno == errno.EROFS
               else f"cannot be created or written ({exc.strerror})")
        raise _refuse(root, source, why) from None
    return root


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if absent). The kernel drops it when the holder
    exits, however it exits, so a killed process never leaves a stale lock behind."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise GlanceError(f"cannot create the lock file {path} ({exc.strerror}); {FIX}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
