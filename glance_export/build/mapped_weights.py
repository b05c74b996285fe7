"""The external weights of an ONNX graph as a read-only map of their data files, for TensorRT's parser to
reference (`load_initializer`) instead of reading them into memory of its own.

Which initializers are external, and where their bytes lie, is read from the graph's protobuf here, a few
fields deep: the edge build installs TensorRT and Polygraphy, not the `onnx` package. Weights the builder
has read stay resident in the map as clean file pages, which the kernel may drop at any time and the builder
reads back from the file if it needs them again; `returning_pages` gives them back while the builder runs,
so the worker's resident set is what it cannot give back: the builder's own copies and the engine.
"""
from __future__ import annotations

import mmap
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from glance_runtime.errors import GlanceError
from glance_runtime.formats.protobuf import LENGTH, VARINT, fields

# The onnx.proto field numbers read here.
MODEL_GRAPH, GRAPH_INITIALIZER = 7, 5
TENSOR_NAME, TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION = 8, 13, 14
ENTRY_KEY, ENTRY_VALUE = 1, 2
LOCATION_EXTERNAL = 1
PAGE_RETURN_S = 0.1  # how often the builder's read pages go back to the kernel


@dataclass(frozen=True)
class ExternalTensor:
    name: str
    location: str  # data file, relative to the graph's directory
    offset: int
    length: int


def _tensor(message: memoryview) -> ExternalTensor | None:
    name, location, entries = "", None, {}
    for field, wire, value in fields(message):
        if field == TENSOR_NAME and wire == LENGTH:
            name = bytes(value).decode()
        elif field == TENSOR_DATA_LOCATION and wire == VARINT:
            location = value
        elif field == TENSOR_EXTERNAL_DATA and wire == LENGTH:
            kv = {f: bytes(v).decode() for f, w, v in fields(value) if w == LENGTH}
            entries[kv.get(ENTRY_KEY)] = kv.get(ENTRY_VALUE)
    if location != LOCATION_EXTERNAL or "location" not in entries or "length" not in entries:
        return None  # inline, or a layout the parser resolves itself
    return ExternalTensor(name, entries["location"], int(entries.get("offset", 0)), int(entries["length"]))


def external_initializers(model: bytes) -> list[ExternalTensor]:
    """The graph's initializers whose data lies in external files (data location EXTERNAL with a length)."""
    found = []
    for field, wire, graph in fields(memoryview(model)):
        if field == MODEL_GRAPH and wire == LENGTH:
            found += [t for f, w, message in fields(graph) if f == GRAPH_INITIALIZER and w == LENGTH
                      for t in [_tensor(message)] if t is not None]
    return found


class WeightMap:
    """Read-only maps of a graph's data files; `address` is where a tensor's bytes lie in this process."""

    def __init__(self, onnx_path: Path, tensors: list[ExternalTensor]):
        self._maps: dict[str, mmap.mmap] = {}
        self._views: dict[str, np.ndarray] = {}
        for location in sorted({t.location for t in tensors}):
            path = onnx_path.parent / location
            try:
                with open(path, "rb") as fh:
                    self._maps[location] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                self.close()
                raise GlanceError(f"cannot map {path}, the weights of {onnx_path.name} ({exc}); re-export the "
                                  f"artifacts or copy them again") from None
            self._views[location] = np.frombuffer(self._maps[location], np.uint8)
        for t in tensors:
            if t.offset + t.length > len(self._maps[t.location]):
                size = len(self._maps[t.location])
                self.close()
                raise GlanceError(f"{t.location} holds {size} bytes and {onnx_path.name} reads {t.name} up to byte "
                                  f"{t.offset + t.length} (a truncated copy?); copy the artifacts again")

    def address(self, tensor: ExternalTensor) -> int:
        return self._views[tensor.location].ctypes.data + tensor.offset

    def return_pages(self) -> None:
        for mapped in self._maps.values():
            mapped.madvise(mmap.MADV_DONTNEED)

    @contextmanager
    def returning_pages(self, every_s: float = PAGE_RETURN_S) -> Iterator[None]:
        """While the body runs (the builder, which releases the GIL), give the mapped pages back every `every_s`."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                self.return_pages()

        worker = threading.Thread(target=loop, name="return-weight-pages", daemon=True)
        worker.start()
        try:
            yield
        finally:
            stop.set()
            worker.join()

    def close(self) -> None:
        self._views.clear()
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
