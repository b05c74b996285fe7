"""Wall time of every graph run of a graph backend (ONNX Runtime, TensorRT), read between rounds.

The loop's RoundLog gives draft and verify time; the graphs' own time tells the runtime's overhead
(everything outside the graphs) apart from the model's cost. The backend installs the clock on its own
graphs (`Backend.time_graphs`), so no caller replaces a backend's parts.
"""
from __future__ import annotations

import time
from typing import Callable

from .device_buffers import Tensor
from .graph import Graph

# the graphs a round runs (vision, where present, only at prefill; draft_vocab only for a head with a reduced
# draft vocabulary, read as 0 ms elsewhere)
GRAPH_NAMES = ("target", "draft", "vocab", "draft_vocab")


class TimedGraph:
    """One graph with a running total of its runs' seconds; `sync` waits for the device's stream, so an
    asynchronous engine's time is charged to the run that queued it."""

    def __init__(self, graph: Graph, sync: Callable[[], None]):
        self.graph, self.sync, self.seconds, self.runs = graph, sync, 0.0, 0
        self.input_names = graph.input_names

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        self.runs += 1
        t0 = time.perf_counter()
        try:
            self.graph.run(inputs, outputs)
            self.sync()
        finally:
            self.seconds += time.perf_counter() - t0


class GraphClock:
    """Timed stand-ins for every graph of one backend (the `decode.backend.GraphTimes` a backend hands out)."""

    def __init__(self, graphs: dict[str, Graph], sync: Callable[[], None]):
        self.graphs = {name: TimedGraph(graph, sync) for name, graph in graphs.items()}

    def reading(self) -> dict[str, float]:
        """Cumulative ms per graph so far (every one of GRAPH_NAMES, 0 where the backend has no such graph)."""
        return {**dict.fromkeys(GRAPH_NAMES, 0.0), **{name: g.seconds * 1e3 for name, g in self.graphs.items()}}

    def runs(self) -> dict[str, int]:
        """Runs per graph so far (as `reading`)."""
        return {**dict.fromkeys(GRAPH_NAMES, 0), **{name: g.runs for name, g in self.graphs.items()}}
