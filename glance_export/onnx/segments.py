"""Run a large ONNX graph in ONNX Runtime one slice of its weights at a time.

A session holds every weight of its graph at once, and on a CPU without fp16 kernels it also holds an
fp32 copy of each fp16 weight (the casts it inserts are folded at load). A full-depth target is then
two to three times its own size in memory. Cut into segments instead, consecutive runs of nodes (the
file's order is topological) carrying at most `budget` bytes of weights each, the graph runs segment
by segment: each segment is a model of its own whose inputs are the graph inputs and the earlier
segments' values it reads, whose weights point into the same data file, and whose session is dropped
before the next one opens. Every node and every weight of the graph runs, on the same inputs, with
the same kernels; only the boundaries between sessions are new.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx

from .node_runs import boundaries, segment_model, split, value_types

SEGMENT_BYTES = 256 << 20


def run_in_segments(path: Path, feeds: list[dict[str, np.ndarray]], budget: int = SEGMENT_BYTES,
                    prepack: bool = False) -> list[dict[str, np.ndarray]]:
    """The graph's outputs for each feed, computed segment by segment (one session open at a time).

    `prepack`: let ONNX Runtime repack weights at load, for a quantized graph, whose MatMulNBits run several
    times slower unpacked and whose packed blocks replace the stored ones (a float graph's packed weights
    would be a second copy)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # fp16 graphs warn about CPU constant folding
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    types = value_types(model)
    initializers = {t.name: t for t in graph.initializer}
    wanted = [o.name for o in graph.output]
    segments = split(graph, budget)
    cuts = boundaries(graph, segments)
    last_read = {name: index for index, (inputs, _) in enumerate(cuts) for name in inputs}
    values = [{k: v for k, v in feed.items()} for feed in feeds]
    fd, scratch = tempfile.mkstemp(prefix=".segment.", suffix=".onnx", dir=path.parent)  # beside the data file
    os.close(fd)
    try:
        for index, (segment, (inputs, outputs)) in enumerate(zip(segments, cuts)):
            onnx.save_model(segment_model(model, segment, inputs, outputs, initializers, types), scratch)
            session = ort.InferenceSession(scratch, options, providers=["CPUExecutionProvider"])
            for held in values:
                held.update(zip(outputs, session.run(outputs, {n: held[n] for n in inputs})))
                for name in [n for n in held if last_read.get(n, -1) <= index and n not in wanted]:
                    del held[name]  # no later segment reads it
            del session
    finally:
        Path(scratch).unlink(missing_ok=True)
    return [{n: held[n] for n in wanted} for held in values]
