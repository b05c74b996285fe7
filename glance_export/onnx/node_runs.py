"""Consecutive runs of an ONNX graph's nodes, each a model of its own: what running a graph in segments
(`onnx.segments`, ONNX Runtime during export) and building it in parts (`engine_parts`, TensorRT) share.

A graph file's node order is topological, so any cut between two nodes splits it into runs whose inputs are
the graph's inputs and the values earlier runs made, and whose outputs are the graph's outputs and the values
later runs read. Every helper reads the weightless protobuf only (weights stay in their data file); this
module imports onnx, never torch, so a build from artifacts can use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data


@dataclass
class Segment:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    weight_bytes: int = 0


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    if uses_external_data(tensor):
        return ExternalDataInfo(tensor).length or 0
    return len(tensor.raw_data)


def weight_bytes(path: Path) -> int:
    """The bytes of a graph file's initializers, read from its protobuf alone."""
    return sum(tensor_bytes(t) for t in onnx.load(str(path), load_external_data=False).graph.initializer)


def reads(node: onnx.NodeProto) -> list[str]:
    """The names a node reads, those its subgraphs (If, Loop, Scan bodies) take from the outer scope included."""
    names = [name for name in node.input if name]
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            inner = {o for n in sub.node for o in n.output} | {i.name for i in sub.input} | \
                {t.name for t in sub.initializer}
            names += [name for n in sub.node for name in reads(n) if name not in inner]
    return names


def live_nodes(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes something still reads (towards `outputs`), in their order: what a rewrite leaves after it has
    rewired readers away from a node."""
    needed = set(outputs)
    keep = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(reads(node))
    return keep[::-1]


def split(graph: onnx.GraphProto, budget: int, can_cut: Callable[[int], bool] = lambda index: True) -> list[Segment]:
    """Consecutive nodes, a new segment whenever the next node's weights would exceed `budget`, at the latest
    node index `can_cut` accepts since the segment began (or, where it accepts none, the first one after)."""
    sizes = {t.name: tensor_bytes(t) for t in graph.initializer}
    weights = [sum(sizes.get(name, 0) for name in set(reads(node))) for node in graph.node]
    starts, start, held = [0], 0, 0
    refused = 0  # can_cut accepts no index from start to here
    for index, node_weights in enumerate(weights):
        if index > start and held + node_weights > budget:
            cut = next((i for i in range(index, max(start, refused), -1) if can_cut(i)), None)
            if cut is None:
                refused = index
            else:
                starts.append(cut)
                start, held = cut, sum(weights[cut:index])
        held += node_weights
    ends = starts[1:] + [len(weights)]
    return [Segment(list(graph.node[a:b]), sum(weights[a:b])) for a, b in zip(starts, ends)]


def crossing(graph: onnx.GraphProto, index: int) -> list[str]:
    """The values a cut before node `index` would pass on: made by an earlier node, read by this one or later."""
    made = {o for node in graph.node[:index] for o in node.output if o}
    return sorted({name for node in graph.node[index:] for name in reads(node)} & made)


def boundaries(graph: onnx.GraphProto, segments: list[Segment]) -> list[tuple[list[str], list[str]]]:
    """Each segment's inputs (the graph inputs and earlier segments' values it reads) and outputs (the graph
    outputs it makes first, and what a later segment reads from it)."""
    initializers = {t.name for t in graph.initializer}
    available = {i.name for i in graph.input}
    wanted, given = {o.name for o in graph.output}, set()
    inputs, produced = [], []
    for segment in segments:
        made = [o for node in segment.nodes for o in node.output if o]
        read = {name for node in segment.nodes for name in reads(node)}
        inputs.append(sorted((read - set(made) - initializers) & available))
        produced.append(made)
        available |= set(made)
    outputs = []
    for index, made in enumerate(produced):
        later = {name for names in inputs[index + 1:] for name in names}
        keep = [n for n in dict.fromkeys(made) if (n in wanted and n not in given) or n in later]
        given |= wanted.intersection(keep)
        outputs.append(keep)
    return list(zip(inputs, outputs))


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor's type, from shape inference over the weightless proto (dims of external weights suffice)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    for tensor in graph.initializer:
        types.setdefault(tensor.name, onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)))
    return types


def segment_model(model: onnx.ModelProto, segment: Segment, inputs: list[str], outputs: list[str],
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
