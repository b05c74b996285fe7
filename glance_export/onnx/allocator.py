"""Weight-sized buffers an export frees go back to the system at once.

glibc serves an allocation above its mmap threshold (128 KiB to start) with a mapping of its own, unmapped
when freed, but raises the threshold to the size of each such buffer freed, up to 32 MiB. Once the export
has freed a few weights, weights of up to 32 MiB come from the heap instead, where what a closed ONNX
Runtime session freed stays resident in pieces the next session's weights do not fit. Validation opens one
session after another (a segment of the full-depth graph each), so the heap grew with the model's depth:
on a 12-layer, 1024-wide target the smoke run's peak stood two layers' weights above a 2-layer export's.
With the threshold pinned the two peaks are within about 15 MB.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; pinning it also turns the raising off
MMAP_THRESHOLD = 1 << 20  # above any activation of the validation feeds, below any weight worth keeping apart


def return_freed_weights() -> None:
    """Pin glibc's mmap threshold for this process (a no-op on other C libraries and systems)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version"):  # musl has no tunable threshold
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
