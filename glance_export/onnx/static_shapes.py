"""Fold the shape arithmetic a weightless trace leaves for sizes that are fixed.

The trace records every `x.shape[i]` as `Shape -> Gather`, and with no weights in hand nothing is
folded at export, so a head size of 128 or a batch of 1 is recomputed on every pass, together with
the Div/Cast/Unsqueeze chains fed by it (about thirty nodes a layer). Symbolic shape inference (ONNX
Runtime's, which follows reshapes through symbolic sizes) says which of those reads are fixed; each
becomes a constant, and what only they fed is removed. Runtimes fold the constant chains left at load.
Reads of a symbolic size (the sequence, the past) stay, except where a Reshape reads them off the very tensor it
reshapes, at the place they keep: that piece of its target becomes ONNX's 0 ("this dim of the input"), so the
per-layer head splits of a batched graph read no shape at all.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

from .node_runs import live_nodes


def _dims(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Every tensor's dims as inferred: ints where fixed, the symbol's name where symbolic, None where unknown.
    The weights are stubs (no values yet), so inference sees them as inputs of their declared shapes."""
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
            out[value.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                               for d in shape.shape.dim]
    return out


def _fixed(dims: list[int | str | None]) -> list[int | None]:
    return [d if isinstance(d, int) else None for d in dims]


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
        shape = _fixed(dims[node.input[0]])[_shape_span(node, len(dims[node.input[0]]))]
        left = []  # readers that are not a fixed pick of it
        for reader in readers.get(node.output[0], []):
            picked = _pick(reader, shape, constants)
            if picked is not None and all(d is not None for d in np.ravel(picked)):
                fixed[reader.output[0]] = np.asarray(picked, dtype=np.int64)
            else:
                left.append(reader)
        if left and all(d is not None for d in shape):
            fixed[node.output[0]] = np.array(shape)
    copied = _copied_dims(graph, dims, constants)
    if not fixed and not copied:
        return 0
    nodes = [_constant(name, np.zeros(1, np.int64))  # the 0s the rewritten targets read, ahead of every reader
             for node in copied.values() for name in node.input if name.startswith(f"{node.output[0]}_copy_")]
    for node in graph.node:
        if node.output and node.output[0] in fixed:
            nodes.append(_constant(node.output[0], fixed[node.output[0]]))
        elif node.output and node.output[0] in copied:
            nodes.append(copied[node.output[0]])
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(live_nodes(nodes, {o.name for o in graph.output}))
    return len(fixed) + len(copied)


def _read_dim(name: str, producers: dict[str, onnx.NodeProto], constants: dict[str, np.ndarray],
              dims: dict[str, list]) -> int | str | None:
    """The dim a one-element shape piece reads, as `_dims` names it: Unsqueeze(Gather(Shape(x), i))."""
    unsqueeze = producers.get(name)
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return None
    gather = producers.get(unsqueeze.input[0])
    if gather is None or gather.op_type != "Gather" or any(a.name == "axis" and a.i != 0 for a in gather.attribute):
        return None
    shape, index = producers.get(gather.input[0]), constants.get(gather.input[1])
    if shape is None or shape.op_type != "Shape" or index is None or index.ndim != 0 or shape.attribute:
        return None
    source = dims.get(shape.input[0])
    return source[int(index)] if source is not None and -len(source) <= int(index) < len(source) else None


def _copied_dims(graph: onnx.GraphProto, dims: dict[str, list], constants: dict[str, np.ndarray]
                 ) -> dict[str, onnx.NodeProto]:
    """Reshape targets built from the sizes of the tensor being reshaped, rewritten to copy them (an ONNX Reshape's
    0 keeps the input's dim at that place): a batched graph's attention reshapes [B, T, H*D] to [B, T, H, D] from
    B and T read off its input, a Shape, two Gathers, two Unsqueezes and a Concat a reshape, every pass. Returns
    the rewritten Concat nodes by output name."""
    producers = {o: n for n in graph.node for o in n.output}
    out: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        if node.op_type != "Reshape" or any(a.name == "allowzero" and a.i for a in node.attribute):
            continue
        concat = producers.get(node.input[1])
        data = dims.get(node.input[0])
        if concat is None or concat.op_type != "Concat" or data is None or concat.output[0] in out:
            continue
        pieces, place = list(concat.input), 0  # place: the target dim the piece starts at
        for i, piece in enumerate(concat.input):
            read = _read_dim(piece, producers, constants, dims)
            if read is None and piece not in constants:
                break  # a piece of unknown length: the places after it are not known
            if place < len(data) and isinstance(data[place], str) and read == data[place]:
                pieces[i] = f"{concat.output[0]}_copy_{place}"
            place += 1 if read is not None else int(constants[piece].size)
        if pieces == list(concat.input):
            continue
        readers = [n for n in graph.node if concat.output[0] in n.input]
        if any(r.op_type != "Reshape" or r.input[0] != node.input[0] for r in readers):
            continue  # the target is read elsewhere too, where a 0 would not mean the same
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(concat)
        del rewritten.input[:]
        rewritten.input.extend(pieces)
        out[concat.output[0]] = rewritten
    return out
