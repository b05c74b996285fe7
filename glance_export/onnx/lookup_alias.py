"""Embedding lookups that read the vocabulary matrix through initializers of their own.

ONNX Runtime's CPU provider repacks a MatMulNBits weight when a session starts and then lets go of the
stored tensor, unless another node still reads it. A tied matrix is read by the LM head's MatMulNBits and
by the lookups' GatherBlockQuantized, so the stored blocks stayed resident beside their repacked copy
(158 MB more at full depth of a 3B-wide model, after the repacking had read every page of them). Where
the weights live in a data file, ONNX Runtime maps initializers from it: a lookup reading initializers of
its own that name the same bytes keeps only the rows it reads resident, and the file still stores the
matrix once. An embedded graph keeps the shared tensor (aliasing it there would store it twice).
"""
from __future__ import annotations

import onnx
from onnx.external_data_helper import uses_external_data

from .node_runs import live_nodes, reads

LOOKUP = "GatherBlockQuantized"
SUFFIX = "_lookup"


def _alias(tensor: onnx.TensorProto, dims: list[int]) -> onnx.TensorProto:
    """An initializer naming the same stored bytes as `tensor`, viewed with `dims` (same element count)."""
    alias = onnx.TensorProto(name=f"{tensor.name}{SUFFIX}", data_type=tensor.data_type, dims=dims,
                             data_location=onnx.TensorProto.EXTERNAL)
    alias.external_data.extend(tensor.external_data)
    return alias


def separate_lookups(model: onnx.ModelProto) -> int:
    """Point every lookup of a matrix another node also reads (a tied one) at its own aliases of the packed
    rows and their scales (the scales as [V, blocks, 1], so the Unsqueeze that lifted them goes too);
    returns how many lookups now read aliases. Call after the data file is written: the aliases copy the
    tensors' offsets."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    shared = {name for node in graph.node if node.op_type != LOOKUP for name in reads(node)}
    added: dict[str, onnx.TensorProto] = {}
    count = 0
    for node in graph.node:
        if node.op_type != LOOKUP:
            continue
        lift = producers.get(node.input[2])
        packed = inits.get(node.input[0])
        scales = inits.get(lift.input[0]) if lift is not None and lift.op_type == "Unsqueeze" else None
        if packed is None or scales is None or packed.name not in shared \
                or not (uses_external_data(packed) and uses_external_data(scales)):
            continue  # an untied table: only lookups read it, so nothing repacks it
        for tensor, dims in ((packed, list(packed.dims)), (scales, [*scales.dims, 1])):
            if tensor.name not in added:
                added[tensor.name] = _alias(tensor, dims)
        node.input[0], node.input[2] = added[packed.name].name, added[scales.name].name
        count += 1
    if not count:
        return 0
    graph.initializer.extend(added.values())
    outputs = {o.name for o in graph.output}
    live = live_nodes(list(graph.node), outputs)  # the lifting Unsqueeze is read no more
    del graph.node[:]
    graph.node.extend(live)
    read = outputs | {name for node in live for name in reads(node)}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return count
