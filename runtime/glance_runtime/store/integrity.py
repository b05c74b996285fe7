"""Files checked against the sha256 their manifest records, cheaply enough to do on every load.

A file is hashed in full only when it is new to this machine or its size, modification time,
change time or inode differ from when it was last hashed; otherwise the digest comes from a small
stamp file per directory under the cache root. Stamps are only kept for files whose times are a
couple of seconds old, so a write landing in the same clock tick as a hash is never trusted.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Iterable, Mapping, Protocol

from .atomic import write_file
from .cache import cache_root
from .input_files import present
from ..errors import GlanceError, IntegrityError

RACY_NS = 2_000_000_000  # a file changed this recently may change again without its times moving


def sha256(path: Path) -> str:
    """Streamed, so multi-GB weights never sit in memory, through one buffer (a fresh 1 MiB chunk per read
    is a fresh mapping, and its page faults cost as much as the hashing)."""
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while size := fh.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class Stamps:
    """Digests of the files in one directory, keyed by name and trusted while their stat key holds."""

    def __init__(self, directory: Path):
        self.directory = Path(directory).resolve()
        tag = hashlib.sha256(str(self.directory).encode()).hexdigest()[:20]
        try:
            self.file: Path | None = cache_root() / "stamps" / f"{tag}.json"
            entries = json.loads(self.file.read_text())
        except GlanceError:  # no usable cache: every load hashes again
            self.file, entries = None, {}
        except (OSError, ValueError, RecursionError):
            entries = {}
        self.entries: dict[str, list] = entries if isinstance(entries, dict) else {}
        self.changed = False

    def digest(self, name: str) -> str:
        path = self.directory / name
        st = path.stat()
        key = _stat_key(st)
        entry = self.entries.get(name)
        if isinstance(entry, list) and entry[:-1] == key and isinstance(entry[-1], str):
            return entry[-1]
        digest = sha256(path)
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS:
            self.entries[name] = [*key, digest]
            self.changed = True
        return digest

    def save(self) -> None:
        """Best effort: without a writable cache the next load just hashes again."""
        if not self.changed or self.file is None:
            return
        try:
            write_file(self.file, json.dumps(self.entries))
        except OSError:
            pass


def file_digest(path: str | Path) -> str:
    """sha256 of one file, through its directory's stamps."""
    path = Path(path)
    stamps = Stamps(path.parent)
    digest = stamps.digest(path.name)
    stamps.save()
    return digest


def record(directory: str | Path, names: list[str]) -> dict[str, dict[str, int | str]]:
    """{name: {sha256, size}} of files in `directory`, as a manifest records them."""
    directory = Path(directory)
    return {name: {"sha256": sha256(directory / name), "size": (directory / name).stat().st_size} for name in names}


def verify_files(directory: str | Path, expected: Mapping[str, Mapping[str, object]], fix: str) -> None:
    """Check every file named in `expected` ({name: {sha256, size or bytes}}) against its recorded size
    and digest; the first mismatch is one IntegrityError naming the file and `fix`."""
    directory = Path(directory)
    stamps = Stamps(directory)
    try:
        for name, want in expected.items():
            path = directory / name
            try:
                if not present(path, "file", fix):  # a FIFO or directory is named, never opened to be hashed
                    raise IntegrityError(f"{path} is missing; {fix}")
            except IntegrityError:
                raise
            except GlanceError as exc:
                raise IntegrityError(str(exc)) from None
            size, recorded = path.stat().st_size, want.get("size", want.get("bytes"))
            if recorded is not None and size != recorded:
                raise IntegrityError(f"{path} is {size} bytes but its manifest records {recorded} (truncated or "
                                  f"replaced); {fix}")
            if stamps.digest(name) != want["sha256"]:
                raise IntegrityError(f"{path} does not match the sha256 its manifest records (corrupted or "
                                  f"modified); {fix}")
    finally:
        stamps.save()


class EngineFile(Protocol):
    file: str
    bytes: int
    sha256: str


def verify_engines(engine_dir: str | Path, files: Iterable[EngineFile]) -> None:
    """The engine files an engines.json record lists (`EnginesRecord.files`: every part of a chained graph
    included), checked before loading."""
    verify_files(engine_dir, {f.file: {"sha256": f.sha256, "bytes": f.bytes} for f in files},
                 "rebuild the engines with `glance-export build`")
