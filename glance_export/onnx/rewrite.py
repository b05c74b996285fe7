"""Graph rewrites on weights: `MatMul(x, Transpose(W))` becomes `Gemm(x, W, transB=1)`, and readers of
`Identity(W)` read W itself.

An LM head exports as a MatMul on the transposed weight. Folded, that transpose is a second copy of
the vocabulary matrix beside the one the embedding Gather reads (a tied matrix stored twice); left
unfolded, ONNX Runtime and TensorRT fold it at load time instead, doubling its memory there. Gemm's
transB reads W in place, so the matrix is stored, loaded and built exactly once.
"""
from __future__ import annotations

import onnx
from onnx import helper


def _rank(model: onnx.ModelProto, name: str) -> int | None:
    """Rank of a value from the graph's inputs and inferred value_info (shapes only, no weights needed)."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.name == name and value.type.tensor_type.HasField("shape"):
            return len(value.type.tensor_type.shape.dim)
    return None


def gemm_for_transposed_weights(model: onnx.ModelProto) -> int:
    """Rewrite in place; returns how many MatMuls became Gemms. Only 2-D activations qualify (Gemm's rule)."""
    graph = model.graph
    weights = {t.name for t in graph.initializer if len(t.dims) == 2}
    transposes = {n.output[0]: n for n in graph.node if n.op_type == "Transpose" and n.input[0] in weights
                  and [a.ints for a in n.attribute if a.name == "perm"] in ([], [[1, 0]])}
    rewritten = 0
    for i, node in enumerate(list(graph.node)):
        if node.op_type != "MatMul" or node.input[1] not in transposes or _rank(model, node.input[0]) != 2:
            continue
        weight = transposes[node.input[1]].input[0]
        gemm = helper.make_node("Gemm", [node.input[0], weight], list(node.output), name=f"{node.name}_gemm",
                                transB=1)
        position = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(position, gemm)
        rewritten += 1
    used = {name for n in graph.node for name in n.input}
    for out, node in transposes.items():
        if out not in used:
            graph.node.remove(node)
    return rewritten


def skip_identities(model: onnx.ModelProto, weights: set[str] | dict) -> None:
    """Readers of `Identity(W)` read W (the tracer aliases a weight read twice this way), so each weight is
    one tensor that later rewrites (transposes stored folded, quantization) see where it is used."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    alias = {n.output[0]: n.input[0] for n in graph.node
             if n.op_type == "Identity" and n.input[0] in weights and n.output[0] not in outputs}
    bypass(graph, alias)


def bypass(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    """Drop the nodes whose (first) output is a key of `renamed`; their readers read its value instead."""
    kept = [n for n in graph.node if not (n.output and n.output[0] in renamed)]
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
    del graph.node[:]
    graph.node.extend(kept)
