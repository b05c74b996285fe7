"""ONNX Runtime sessions of small graphs opened from a cached, already optimised copy, so a reload skips the
graph optimisation that dominates opening them.

On the embedded default, optimising its four graphs is about four fifths of `load()`, and it is the same
work on every load of the same graph. ONNX Runtime saves the optimised graph in its own format and opens
that without optimising again: the same graph and the same kernels, so answers do not change. An entry is
keyed by the sha256 of the source graph (the one its manifest records, verified by the load before this
runs), the onnxruntime version, the providers and the CPU (optimised graphs are specific to it), and is
checked against what is recorded beside it when it was written (the source graph's sha256 and its own): a
damaged entry, or one moved or swapped with another, is rebuilt, never run.
Only the CPU provider is cached (compiled providers cannot be saved), and only graphs without external
weights under MAX_BYTES: larger graphs spend their load reading weights, and a second copy of gigabytes
in the cache is not worth it. Without a usable cache the graph is opened as usual.
"""
from __future__ import annotations

import hashlib
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from ..store.cache import cache_root, file_lock
from ..errors import GlanceError
from ..store.integrity import file_digest, sha256

MAX_BYTES = 64 << 20
FORMAT = 1  # of the cache entries


@lru_cache(maxsize=1)
def _cpu() -> str:
    """What the optimised graph may depend on: the architecture and, on Linux, the instruction-set flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _entry(source: Path, digest: str, providers: Sequence[str], version: str) -> Path | None:
    """Where the optimised copy of `source` lives, or None when it is not cached."""
    if list(providers) != ["CPUExecutionProvider"] or source.stat().st_size > MAX_BYTES \
            or source.with_name(f"{source.name}.data").exists():
        return None
    try:
        root = cache_root() / "ort"
    except GlanceError:
        return None
    key = hashlib.sha256(f"{FORMAT}:{version}:{','.join(providers)}:{_cpu()}:{digest}".encode()).hexdigest()[:24]
    return root / f"{key}.ort"


def open_cached(ort: Any, source: Path, digest: str, providers: Sequence[str], options: Callable[[], Any]) -> Any:
    """An InferenceSession of `source` (whose verified sha256 is `digest`); `options()` makes fresh
    SessionOptions (each session here sets its own fields)."""
    entry = _entry(source, digest, providers, ort.__version__)
    if entry is None:
        return ort.InferenceSession(str(source), sess_options=options(), providers=list(providers))
    stamp = entry.with_name(f"{entry.name}.sha256")
    try:
        if entry.is_file() and stamp.is_file() and stamp.read_text().split() == [digest, file_digest(entry)]:
            opened = options()
            opened.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done when saved
            return ort.InferenceSession(str(entry), sess_options=opened, providers=list(providers))
    except OSError:
        pass
    return _build(ort, source, digest, entry, stamp, providers, options)


def _build(ort: Any, source: Path, digest: str, entry: Path, stamp: Path, providers: Sequence[str],
           options: Callable[[], Any]) -> Any:
    """Open `source` as usual while saving its optimised graph, then publish the copy and its digest (a
    failure to write only loses the saving)."""
    saving = options()
    partial = entry.with_name(f".{entry.name}.{os.getpid()}.partial.ort")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(entry.with_name(f"{entry.name}.lock")):
            saving.optimized_model_filepath = str(partial)
            saving.add_session_config_entry("session.save_model_format", "ORT")
            session = ort.InferenceSession(str(source), sess_options=saving, providers=list(providers))
            stamp.unlink(missing_ok=True)
            os.replace(partial, entry)
            stamp.write_text(f"{digest} {sha256(entry)}")
            return session
    except Exception:  # no cache, or a graph this onnxruntime cannot save: open it as usual (a bad graph fails there)
        return ort.InferenceSession(str(source), sess_options=options(), providers=list(providers))
    finally:
        partial.unlink(missing_ok=True)
