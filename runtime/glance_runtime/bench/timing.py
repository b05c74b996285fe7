"""Wall time of every graph run of a graph backend (ONNX Runtime, TensorRT), split per round.

The loop's RoundLog gives draft and verify time; the graphs' own time, read between rounds, tells
the runtime's overhead (everything outside the graphs) apart from the model's cost.
"""
from __future__ import annotations

import time
from typing import Callable

GRAPH_NAMES = ("target", "draft", "vocab")


class TimedGraph:
    """One graph with a running total of its runs' seconds; `sync` waits for the device's stream, so an
    asynchronous engine's time is charged to the run that queued it."""

    def __init__(self, graph, sync: Callable[[], None]):
        self.graph, self.sync, self.seconds = graph, sync, 0.0
        self.input_names = graph.input_names

    def run(self, inputs, outputs) -> None:
        t0 = time.perf_counter()
        try:
            self.graph.run(inputs, outputs)
            self.sync()
        finally:
            self.seconds += time.perf_counter() - t0


class GraphClock:
    """Installs TimedGraph on a graph backend's target, draft and vocab graphs; None for other backends."""

    def __init__(self, backend):
        sync = backend.device.synchronize
        self.graphs = {name: TimedGraph(backend.graphs[name], sync) for name in GRAPH_NAMES}
        backend.graphs.update(self.graphs)

    @classmethod
    def attach(cls, backend) -> "GraphClock | None":
        graphs = getattr(backend, "graphs", None)
        return cls(backend) if isinstance(graphs, dict) and all(n in graphs for n in GRAPH_NAMES) else None

    def reading(self) -> dict[str, float]:
        """Cumulative ms per graph so far."""
        return {name: g.seconds * 1e3 for name, g in self.graphs.items()}
