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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

SEGMENT_BYTES = 256 << 20


@dataclass
class Segment:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    weight_bytes: int = 0


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    if uses_external_data(tensor):
        return ExternalDataInfo(tensor).length or 0
    return len(tensor.raw_data)


def weight_bytes(path: Path) -> int:
    """The bytes of a graph file's initializers, read from its protobuf alone."""
    return sum(_tensor_bytes(t) for t in onnx.load(str(path), load_external_data=False).graph.initializer)


def reads(node: onnx.NodeProto) -> list[str]:
    """The names a node reads, those its subgraphs (If, Loop, Scan bodies) take from the outer scope included."""
    names = [name for name in node.input if name]
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            inner = {o for n in sub.node for o in n.output} | {i.name for i in sub.input} | \
                {t.name for t in sub.initializer}
            names += [name for n in sub.node for name in reads(n) if name not in inner]
    return names


def split(graph: onnx.GraphProto, budget: int) -> list[Segment]:
    """Consecutive nodes, a new segment whenever the next node's weights would exceed `budget`."""
    sizes = {t.name: _tensor_bytes(t) for t in graph.initializer}
    segments = [Segment()]
    for node in graph.node:
        weights = sum(sizes.get(name, 0) for name in set(reads(node)))
        if segments[-1].nodes and segments[-1].weight_bytes + weights > budget:
            segments.append(Segment())
        segments[-1].nodes.append(node)
        segments[-1].weight_bytes += weights
    return segments


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor's type, from shape inference over the weightless proto (dims of external weights suffice)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    for tensor in graph.initializer:
        types.setdefault(tensor.name, onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)))
    return types


def _segment_model(model: onnx.ModelProto, segment: Segment, inputs: list[str], outputs: list[str],
                   initializers: dict[str, onnx.TensorProto], types: dict[str, onnx.TypeProto]) -> onnx.ModelProto:
    def info(name: str) -> onnx.ValueInfoProto:
        value = onnx.ValueInfoProto(name=name)
        value.type.CopyFrom(types[name])
        return value

    used = {name for node in segment.nodes for name in reads(node)}
    graph = onnx.helper.make_graph(segment.nodes, "segment", [info(n) for n in inputs], [info(n) for n in outputs],
                                   [initializers[n] for n in sorted(used & initializers.keys())])
    return onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version,
                                  functions=model.functions)


def run_in_segments(path: Path, feeds: list[dict[str, np.ndarray]], budget: int = SEGMENT_BYTES
                    ) -> list[dict[str, np.ndarray]]:
    """The graph's outputs for each feed, computed segment by segment (one session open at a time)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # fp16 graphs warn about CPU constant folding
    options.add_session_config_entry("session.disable_prepacking", "1")  # packed weights would be a second copy
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    types = _value_types(model)
    initializers = {t.name: t for t in graph.initializer}
    wanted = [o.name for o in graph.output]
    segments = split(graph, budget)
    readers: dict[str, int] = {}  # tensor -> index of the last segment that reads it
    for index, segment in enumerate(segments):
        for node in segment.nodes:
            for name in reads(node):
                readers[name] = index
    values = [{k: v for k, v in feed.items()} for feed in feeds]
    fd, scratch = tempfile.mkstemp(prefix=".segment.", suffix=".onnx", dir=path.parent)  # beside the data file
    os.close(fd)
    try:
        for index, segment in enumerate(segments):
            produced = [o for node in segment.nodes for o in node.output if o]
            made = set(produced)
            read = {name for node in segment.nodes for name in reads(node)}
            inputs = sorted(n for n in read - made - initializers.keys() if n in values[0])
            outputs = [n for n in produced if n in wanted or readers.get(n, -1) > index]
            onnx.save_model(_segment_model(model, segment, inputs, outputs, initializers, types), scratch)
            session = ort.InferenceSession(scratch, options, providers=["CPUExecutionProvider"])
            for held in values:
                held.update(zip(outputs, session.run(outputs, {n: held[n] for n in inputs})))
                for name in [n for n in held if readers.get(n, -1) <= index and n not in wanted]:
                    del held[name]  # no later segment reads it
            del session
    finally:
        Path(scratch).unlink(missing_ok=True)
    return [{n: held[n] for n in wanted} for held in values]
