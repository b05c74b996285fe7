"""Where the runtime keeps what it can rebuild (exports, hash stamps), and the lock that lets
several processes share it: the first one builds an entry, the others wait and reuse it."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def cache_root() -> Path:
    """`$GLANCE_CACHE`, else ~/.cache/glance."""
    return Path(os.environ.get("GLANCE_CACHE", Path.home() / ".cache" / "glance"))


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if absent). The kernel drops it when the holder
    exits, however it exits, so a killed process never leaves a stale lock behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
