"""One graph run as a chain of parts: a graph too large to build whole is built as consecutive parts, and this
runs them in order as if they were the one graph (`graph.Graph`).

Each part reads some of the caller's inputs and the values earlier parts made, and writes some of the caller's
outputs and the values later parts read. The caller's views are bound where a part reads or writes them; the
values between parts live in device buffers the chain owns, one per value, sized by the pass's own shapes
(each part says what its outputs' shapes are for the shapes it is given), grown when a pass needs more and
reused otherwise, so a steady decode allocates nothing. Nothing here is tied to one runtime: TensorRT parts
(`trt_backend.TrtGraph`) and ONNX Runtime parts (`ort_backend.OrtGraph`, how the CPU tests run the chain)
both implement `PartGraph`.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable, Protocol, Sequence

import numpy as np

from .device_buffers import Buffer, Device, Tensor
from ..errors import GlanceError


class PartGraph(Protocol):
    """A graph that can say its outputs' shapes before it runs (TensorRT: `get_tensor_shape` once the input
    shapes are set)."""

    input_names: frozenset[str]
    output_dtypes: dict[str, np.dtype]

    def output_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Every output's shape for a pass with these input shapes."""

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """As `graph.Graph.run`."""


@dataclass(frozen=True)
class Part:
    graph: PartGraph
    inputs: tuple[str, ...]  # what it reads: the caller's inputs and earlier parts' values
    outputs: tuple[str, ...]  # what it writes: the caller's outputs and the values later parts read
    name: str  # for messages: its file


class ChainGraph:
    """Parts run in order on one device; see the module docstring."""

    def __init__(self, parts: Sequence[Part], device: Device):
        if not parts:
            raise GlanceError("a chained graph needs at least one part; rebuild the engines")
        self.parts, self.device = list(parts), device
        made: set[str] = set()
        given: set[str] = set()
        for part in self.parts:
            given |= set(part.inputs) - made
            made |= set(part.outputs)
        self.input_names = frozenset(given)
        self.output_names = frozenset(made)
        self._buffers: dict[str, Buffer] = {}

    def _boundary(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> Tensor:
        """A view of `shape` in the value's own buffer, grown (never shrunk) to the largest pass so far."""
        need = prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.shape[0] < need:
            if buffer is not None:
                self.device.free(buffer)
            buffer = self._buffers[name] = self.device.empty((max(need, 1),), dtype)
        return buffer.tensor(shape)

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        views = {**inputs, **outputs}
        for part in self.parts:
            missing = [n for n in part.inputs if n not in views]
            if missing:
                raise GlanceError(f"{part.name} reads {', '.join(missing)}, which neither the pass nor an earlier part "
                                  f"gives; rebuild the engines")
            bound = {n: views[n] for n in part.inputs}
            shapes = part.graph.output_shapes({n: tuple(t.shape) for n, t in bound.items()})
            written = {}
            for name in part.outputs:
                if name in outputs:
                    if tuple(outputs[name].shape) != tuple(shapes[name]):
                        raise GlanceError(f"{part.name} writes {name} as {tuple(shapes[name])} but the pass binds "
                                          f"{tuple(outputs[name].shape)}; rebuild the engines")
                    written[name] = outputs[name]
                else:
                    written[name] = views[name] = self._boundary(name, tuple(shapes[name]),
                                                                 part.graph.output_dtypes[name])
            part.graph.run(bound, written)

    def held_bytes(self) -> int:
        """Bytes of the buffers between parts (what the chain adds to the device's memory)."""
        return sum(b.nbytes for b in self._buffers.values())

    def close(self) -> None:
        for buffer in self._buffers.values():
            self.device.free(buffer)
        self._buffers = {}


def chain(entries: Sequence, open_part: Callable[[object], PartGraph], device: Device) -> ChainGraph:
    """A chain of the parts `entries` lists in run order (each with file, inputs and outputs, as engines.json
    records them), each opened by `open_part`."""
    return ChainGraph([Part(open_part(e), tuple(e.inputs), tuple(e.outputs), e.file) for e in entries], device)
