"""The nodes of both quantized forms, rewritten on a graph loaded without its weights.

Only names, shapes and node wiring change here; every new tensor is a stub (name, type, shape) that
`quant_write.py` fills per tensor. The ONNX Runtime form is what `MatMulNBitsQuantizer` makes of the
graph (same node and tensor names and attributes), so a reader of either cannot tell them apart.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.version_converter
from onnx import helper, numpy_helper

from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import VOCABULARY_GRAPHS

from .quant_scheme import Scheme
from .node_runs import reads

TENSORRT_OPSET = 21  # blocked DequantizeLinear and the int4 type
_MS = "com.microsoft"


@dataclass(frozen=True)
class Weight:
    """One fp32 initializer to quantize and the names of what it becomes in each form.

    `rows`: a vocabulary matrix [V, H], blocked along H, its rows MatMulNBits' N (chunks of rows are
    independent); otherwise a MatMul's B [K, N], blocked along K."""

    name: str
    shape: tuple[int, int]
    rows: bool
    packed: str
    scales: str

    @property
    def k(self) -> int:
        return self.shape[1] if self.rows else self.shape[0]

    @property
    def n(self) -> int:
        return self.shape[0] if self.rows else self.shape[1]


def _stub(name: str, data_type: int, dims: list[int]) -> onnx.TensorProto:
    return onnx.TensorProto(name=name, data_type=data_type, dims=dims)


def _matmul_weight(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> onnx.TensorProto | None:
    """B of a MatMul when it is a constant 2-D fp32 matrix (what the quantizer takes)."""
    if node.op_type != "MatMul" or node.input[1] not in inits:
        return None
    tensor = inits[node.input[1]]
    return tensor if len(tensor.dims) == 2 and tensor.data_type == onnx.TensorProto.FLOAT else None


def _lm_head(graph: onnx.GraphProto) -> onnx.NodeProto:
    gemms = [n for n in graph.node if n.op_type == "Gemm"]
    if len(gemms) != 1 or {a.name: a.i for a in gemms[0].attribute}.get("transB") != 1 or len(gemms[0].input) != 2:
        raise GlanceError("the vocab graph's LM head is not one bias-free Gemm with transB=1; re-export the artifacts")
    return gemms[0]


def _matmul_nbits(a: str, weight: Weight, out: list[str], name: str, scheme: Scheme) -> onnx.NodeProto:
    return helper.make_node("MatMulNBits", [a, weight.packed, weight.scales], out, name=name, domain=_MS,
                            K=weight.k, N=weight.n, bits=scheme.bits, block_size=scheme.group_size,
                            **({"accuracy_level": scheme.accuracy_level} if scheme.accuracy_level else {}))


def _gather_block_quantized(graph: onnx.GraphProto, table: str, weight: Weight, scheme: Scheme) -> int:
    """Every Gather on `table` -> GatherBlockQuantized on the packed rows, reshaped to [..., H]. Returns the count."""
    lifted = f"{weight.scales}_blocks"  # [V, blocks, 1]: the rank GatherBlockQuantized wants for [V, blocks, blob]
    nodes, count = [], 0
    for node in graph.node:
        if node.op_type != "Gather" or node.input[0] != table:
            nodes.append(node)
            continue
        if count == 0:
            nodes.append(helper.make_node("Unsqueeze", [weight.scales, "embed_scale_axis"], [lifted],
                                          name="embed_scales"))
        ids, out, tag = node.input[1], node.output[0], f"embed_{count}"
        nodes += [helper.make_node("GatherBlockQuantized", [weight.packed, ids, lifted], [f"{tag}_blocks"],
                                   domain=_MS, bits=scheme.bits, block_size=scheme.group_size, gather_axis=0,
                                   quantize_axis=2, name=f"{tag}_gather"),
                  helper.make_node("Shape", [ids], [f"{tag}_ids_shape"], name=f"{tag}_shape"),
                  helper.make_node("Concat", [f"{tag}_ids_shape", "embed_width"], [f"{tag}_shape"], axis=0,
                                   name=f"{tag}_concat"),
                  helper.make_node("Reshape", [f"{tag}_blocks", f"{tag}_shape"], [out], name=f"{tag}_reshape")]
        count += 1
    graph.initializer.extend([numpy_helper.from_array(np.array([2], np.int64), "embed_scale_axis"),
                              numpy_helper.from_array(np.array([weight.k], np.int64), "embed_width")])
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def onnxruntime_form(model: onnx.ModelProto, graph_name: str,
                     scheme: Scheme) -> tuple[dict[str, Weight], dict[str, Any]]:
    """Rewrite `model` in place: every constant MatMul weight read by MatMulNBits, the vocab graph's LM head
    `Gemm(hidden, W, transB=1)` as MatMulNBits on the rows of W, its embedding Gather as GatherBlockQuantized
    (a tied matrix: the LM head's packed rows). Returns the weights to quantize by fp32 name and what was
    quantized (op counts; tied for the vocab graph)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    bits = scheme.bits
    weights: dict[str, Weight] = {}
    head = _lm_head(graph) if graph_name in VOCABULARY_GRAPHS else None
    nodes = []
    for node in graph.node:
        tensor = _matmul_weight(node, inits)
        if node is head:
            w = inits[node.input[1]]
            weights[w.name] = Weight(w.name, tuple(w.dims), True, f"{w.name}.T_Q{bits}", f"{w.name}.T_scales")
            nodes.append(_matmul_nbits(node.input[0], weights[w.name], list(node.output), f"lm_head_matmul_Q{bits}",
                                       scheme))
        elif tensor is not None:
            weight = weights.setdefault(tensor.name, Weight(tensor.name, tuple(tensor.dims), False,
                                                            f"{tensor.name}_Q{bits}", f"{tensor.name}_scales"))
            nodes.append(_matmul_nbits(node.input[0], weight, list(node.output),
                                       f"{node.name}_Q{bits}" if node.name else "", scheme))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    record: dict[str, Any] = {"MatMulNBits": len(weights)}
    if head is not None:
        floats = {name for name, t in inits.items() if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
        tables = {n.input[0] for n in graph.node if n.op_type == "Gather"} & floats  # not a draft vocabulary's id map
        if len(tables) != 1:
            raise GlanceError("the vocab graph does not read one embedding table; re-export the artifacts")
        table = tables.pop()
        if table not in weights:  # untied: the embedding is quantized by the same routine, as rows
            t = inits[table]
            weights[table] = Weight(table, tuple(t.dims), True, f"{table}_Q{bits}", f"{table}_scales")
        record["GatherBlockQuantized"] = _gather_block_quantized(graph, table, weights[table], scheme)
        record["tied"] = table == head.input[1]
    read = {o.name for o in graph.output} | {name for node in graph.node for name in reads(node)}
    keep = [t for t in graph.initializer if t.name not in weights or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    for weight in weights.values():
        blocks = -(-weight.k // scheme.group_size)
        graph.initializer.extend([_stub(weight.packed, onnx.TensorProto.UINT8,
                                        [weight.n, blocks, scheme.group_size * bits // 8]),
                                  _stub(weight.scales, onnx.TensorProto.FLOAT, [weight.n, blocks])])
    for opset in model.opset_import:
        if opset.domain == _MS:
            opset.version = 1
            break
    else:
        model.opset_import.append(helper.make_opsetid(_MS, 1))
    return weights, record


@dataclass(frozen=True)
class Dequantized:
    """Names of the TensorRT form's stored integers and scales of one weight."""

    data: str
    scale: str


def tensorrt_form(model: onnx.ModelProto, graph_name: str, weights: dict[str, Weight],
                  scheme: Scheme) -> tuple[onnx.ModelProto, dict[str, Dequantized], list[str]]:
    """The fp32 graph at opset 21 with each quantized weight replaced by blocked DequantizeLinear nodes of the
    same integers, one node per reader, all reading the one stored tensor (a tied matrix is still stored once).

    A MatMul weight read by two MatMuls (the head's K/V projections, applied to context and block) stays
    fp32 here: TensorRT-RTX 1.7's compiler fails with an internal error on the draft graph when those are
    dequantized. Returns the graph, the new tensors' names by fp32 name and the names left fp32."""
    model = at_opset(model, TENSORRT_OPSET)
    graph = model.graph
    axis = 1 if graph_name in VOCABULARY_GRAPHS else 0  # vocabulary matrices are [V, H]; MatMul weights are [K, N]
    readers = Counter(name for node in graph.node for name in node.input)
    kept = sorted(name for name in weights if graph_name not in VOCABULARY_GRAPHS and readers[name] > 1)
    kind = onnx.TensorProto.INT4 if scheme.bits == 4 else onnx.TensorProto.INT8
    stubs: dict[str, Dequantized] = {}
    keep, added = [], []
    for tensor in graph.initializer:
        weight = weights.get(tensor.name)
        if weight is None or tensor.name in kept:
            keep.append(tensor)
            continue
        blocks = -(-weight.k // scheme.group_size)
        stubs[tensor.name] = Dequantized(f"{tensor.name}_q{scheme.bits}", f"{tensor.name}_scale")
        added += [_stub(stubs[tensor.name].data, kind, list(weight.shape)),
                  _stub(stubs[tensor.name].scale, onnx.TensorProto.FLOAT,
                        [weight.n, blocks] if weight.rows else [blocks, weight.n])]
    nodes = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in stubs:
                node.input[i] = f"{name}_dq{len(nodes)}"
                nodes.append(helper.make_node("DequantizeLinear", [stubs[name].data, stubs[name].scale],
                                              [node.input[i]], axis=axis, block_size=scheme.group_size,
                                              name=f"{node.input[i]}_node"))
        nodes.append(node)
    del graph.initializer[:]
    graph.initializer.extend(keep + added)
    del graph.node[:]
    graph.node.extend(nodes)
    return model, stubs, kept


def at_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """onnx's version converter on the graph without its weights (they do not change, and a >2 GB proto
    cannot pass through the converter), then the weights put back."""
    weights = list(model.graph.initializer)
    del model.graph.initializer[:]
    for tensor in weights:
        model.graph.initializer.append(onnx.TensorProto(name=tensor.name, data_type=tensor.data_type,
                                                        dims=tensor.dims))
    converted = onnx.version_converter.convert_version(model, opset)
    del converted.graph.initializer[:]
    converted.graph.initializer.extend(weights)
    converted.ir_version = max(converted.ir_version, 10)
    return converted
