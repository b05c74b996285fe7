"""The one thing a graph backend asks of a graph, whatever runs it (an ONNX Runtime session, a TensorRT
context, a chain of parts, a timed stand-in)."""
from __future__ import annotations

from typing import Protocol

from .device_buffers import Tensor


class Graph(Protocol):
    """One graph that runs on bound device views (ONNX Runtime IOBinding, a TensorRT context)."""

    input_names: frozenset[str]

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """Run with every input and output bound at the given views; returns once outputs are written
        (on the device's stream)."""
