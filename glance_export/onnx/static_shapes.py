"""Fold the shape arithmetic a weightless trace leaves for sizes that are fixed.

The trace records every `x.shape[i]` as `Shape -> Gather`, and with no weights in hand nothing is
folded at export, so a head size of 128 or a batch of 1 is recomputed on every pass, together with
the Div/Cast/Unsqueeze chains fed by it (about thirty nodes a layer). Symbolic shape inference (ONNX
Runtime's, which follows reshapes through symbolic sizes) says which of those reads are fixed; each
becomes a constant, and what only they fed is removed. Runtimes fold the constant chains left at load.
Reads of a symbolic size (the sequence, the past) stay.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

from .node_runs import live_nodes


def _dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Every tensor's dims as inferred: ints where fixed, None where symbolic or unknown. The weights are
    stubs (no values yet), so inference sees them as inputs of their declared shapes."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    weights = list(probe.graph.initializer)
    del probe.graph.initializer[:]
    probe.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in weights)
    graph = SymbolicShapeInference.infer_shapes(probe, auto_merge=True).graph
    out = {t.name: list(t.dims) for t in weights}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        shape = value.type.tensor_type
        if shape.HasField("shape"):
            out[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in shape.shape.dim]
    return out


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    values.update({t.name: numpy_helper.to_array(t) for t in graph.initializer
                   if t.data_type == onnx.TensorProto.INT64 and (t.HasField("raw_data") or t.int64_data)})
    return values


def _shape_span(node: onnx.NodeProto, rank: int) -> slice:
    attrs = {a.name: a.i for a in node.attribute}
    return slice(attrs.get("start", 0), attrs.get("end", rank))


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"{name}_fixed",
                            value=numpy_helper.from_array(np.asarray(value, dtype=np.int64)))


def _pick(reader: onnx.NodeProto, shape: list[int | None], constants: dict[str, np.ndarray]) -> np.ndarray | None:
    """The dims a reader of a shape takes, where constant inputs say which: a Gather's index, or a Slice's one
    range along the shape (`x.shape[-1]` in a batched graph, whose other dims are symbolic); else None."""
    if reader.op_type == "Gather":
        index = constants.get(reader.input[1])
        if index is None or any(a.name == "axis" and a.i != 0 for a in reader.attribute):
            return None
        return np.take(np.array(shape, dtype=object), index)
    if reader.op_type != "Slice" or len(reader.input) < 3:
        return None
    given = [constants.get(name) if name else None for name in reader.input[1:]]
    starts, ends = given[0], given[1]
    axes, steps = (given + [None, None])[2:4]
    if starts is None or ends is None or len(starts) != 1 or (axes is not None and list(axes) != [0]) \
            or (steps is not None and list(steps) != [1]):
        return None
    return np.array(shape[int(starts[0]):int(ends[0])], dtype=object)  # Python's clamping is Slice's


def fold_static_shapes(model: onnx.ModelProto) -> int:
    """Rewrite in place; returns how many shape reads became constants."""
    graph = model.graph
    dims = _dims(model)
    constants = _constants(graph)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    fixed: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type != "Shape" or dims.get(node.input[0]) is None:
            continue
        shape = dims[node.input[0]][_shape_span(node, len(dims[node.input[0]]))]
        left = []  # readers that are not a fixed pick of it
        for reader in readers.get(node.output[0], []):
            picked = _pick(reader, shape, constants)
            if picked is not None and all(d is not None for d in np.ravel(picked)):
                fixed[reader.output[0]] = np.asarray(picked, dtype=np.int64)
            else:
                left.append(reader)
        if left and all(d is not None for d in shape):
            fixed[node.output[0]] = np.array(shape)
    if not fixed:
        return 0
    nodes = []
    for node in graph.node:
        if node.output and node.output[0] in fixed:
            nodes.append(_constant(node.output[0], fixed[node.output[0]]))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(live_nodes(nodes, {o.name for o in graph.output}))
    return len(fixed)
