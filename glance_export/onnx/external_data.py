"""Gather a graph's weights into one external data file without holding them all in memory.

The TorchScript exporter writes a >2 GB graph as one file per tensor; loading that back into a
ModelProto to re-save it would need the weights in RAM a second time (beside the torch model), which
an 8B target on a 24 GB machine does not have. Tensors are streamed file by file instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

ALIGN = 4096  # page-aligned offsets let runtimes mmap each tensor


def graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and Constant-node tensors, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                yield from graph_tensors(sub)


def gather_external_data(model: onnx.ModelProto, src_dir: Path, dst: Path) -> None:
    """Copy every external tensor of `model` (files under src_dir) into `<dst>.data`; save the graph at dst."""
    data_name = f"{dst.name}.data"
    offset = 0
    with open(dst.with_name(data_name), "wb") as out:
        for tensor in graph_tensors(model.graph):
            if not uses_external_data(tensor):
                continue
            info = ExternalDataInfo(tensor)
            out.write(b"\0" * ((-offset) % ALIGN))
            offset += (-offset) % ALIGN
            length = _copy(src_dir / info.location, info.offset or 0, info.length, out)
            point_external(tensor, data_name, offset, length)
            offset += length
    onnx.save_model(model, str(dst))


def point_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Re-point an external tensor (its bytes are not in memory, so onnx's setter cannot be used)."""
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _copy(path: Path, start: int, length: int | None, out) -> int:
    """Append `length` bytes of path from `start` (to its end when None) to out, in 16 MiB chunks."""
    remaining = path.stat().st_size - start if length is None else length
    total = remaining
    with open(path, "rb") as src:
        src.seek(start)
        while remaining:
            chunk = src.read(min(remaining, 1 << 24))
            if not chunk:
                raise OSError(f"{path} ends before its declared tensor length")
            out.write(chunk)
            remaining -= len(chunk)
    return total
