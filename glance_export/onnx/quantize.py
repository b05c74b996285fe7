"""Weight-only int8/int4 quantization of exported graphs, in the two forms the deployment runtimes read.

Decoding on an edge device is bound by the weight bytes read per token, so the target's and the head's
linear layers and the vocabulary matrices are stored block-quantized (symmetric round-to-nearest, one
fp32 scale per `group_size` weights along the input axis); activations, norms, biases and the vision
tower stay in the export's dtype. ONNX Runtime's own quantizer (`MatMulNBitsQuantizer`) computes the
blocks once; both forms are made from those integers and scales:

- ONNX Runtime form (the artifacts' graph files): `MatMulNBits` for every constant MatMul weight, the LM
  head included (its `Gemm(hidden, W, transB=1)` becomes a MatMul first), and `GatherBlockQuantized`
  for the embedding. MatMulNBits stores B as [N, blocks, blob] rows of W, the embedding's own layout, so
  a tied matrix stays ONE quantized tensor read by the LM head and by every embedding lookup.
- TensorRT form (`tensorrt/<graph>.onnx`): the fp32 graph with each quantized weight replaced by a
  blocked `DequantizeLinear` (opset 21, int4/int8, zero point 0) of the same integers, except that
  TensorRT needs positive scales (see `_positive`); a tied matrix is one DequantizeLinear feeding the
  Gather and the Gemm.
"""
from __future__ import annotations

import importlib.metadata
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnx.version_converter
from onnx import helper, numpy_helper

from glance_runtime.errors import GlanceError

from .rewrite import skip_identities

SCHEMES = {"int8": 8, "int4": 4}
GROUP_SIZES = (32, 64, 128)
GRAPHS = ("target", "draft", "vocab")  # the vision tower runs once per image: it stays in the export's dtype
TENSORRT_DIR = "tensorrt"
TENSORRT_OPSET = 21  # blocked DequantizeLinear and the int4 type
EXTERNAL_BYTES = 1_500_000_000  # graphs above this keep their weights in `<graph>.onnx.data`
_MS = "com.microsoft"


@dataclass(frozen=True)
class Scheme:
    name: str
    group_size: int

    @property
    def bits(self) -> int:
        return SCHEMES[self.name]


def check_scheme(name: str, group_size: int, hidden: int, dtype: str) -> Scheme:
    """One-line refusals for a scheme these graphs cannot take."""
    if name not in SCHEMES:
        raise GlanceError(f"unknown --quantize {name!r}; use one of {', '.join(SCHEMES)}")
    if group_size not in GROUP_SIZES:
        raise GlanceError(f"--group-size {group_size} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
    if hidden % group_size:
        raise GlanceError(f"--group-size {group_size} does not divide the hidden size {hidden}; pick a smaller one")
    if dtype != "fp32":
        raise GlanceError("--quantize keeps fp32 activations and scales; export with --dtype fp32")
    return Scheme(name, group_size)


@dataclass
class Blocks:
    """One quantized weight: unsigned stored values (zero point 2^(bits-1)) and scales, both in W's row order
    of the MatMulNBits layout: q[N, K] and scales[N, K / group]."""

    q: np.ndarray
    scales: np.ndarray


def _quantizer(model: onnx.ModelProto, scheme: Scheme):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer, logger

    logger.setLevel(logging.WARNING)  # it logs every node of the graph at INFO
    # accuracy_level stays unset (fp32 activations). The int8-activation level is several times faster on
    # ONNX Runtime's CPU kernels, but its results depend on how many rows a pass has, so a tree verify and a
    # one-row greedy step disagree (measured: GLANCE diverged from greedy on a 3B-width int8 model), which
    # would break losslessness against the deployed model.
    return MatMulNBitsQuantizer(model, bits=scheme.bits, block_size=scheme.group_size, is_symmetric=True,
                                op_types_to_quantize=("MatMul",))


def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def _skip_weight_identities(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every MatMul on a weight sees the initializer, so the weight is quantized once, not kept fp32 beside it."""
    skip_identities(model, set(_initializers(model.graph)))
    return model


def _one_tensor_per_name(model: onnx.ModelProto) -> onnx.ModelProto:
    """The quantizer writes a weight read by two MatMuls once per MatMul, under one name (the same values):
    keep one."""
    seen, keep = set(), []
    for tensor in model.graph.initializer:
        if tensor.name not in seen:
            seen.add(tensor.name)
            keep.append(tensor)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return model


def _lm_head_as_matmul(model: onnx.ModelProto) -> tuple[str, str]:
    """Gemm(hidden, W, transB=1) -> MatMul(hidden, W^T) with W^T a new initializer, which the quantizer
    turns back into rows of W. Returns (W's name, W^T's name)."""
    graph = model.graph
    gemms = [n for n in graph.node if n.op_type == "Gemm"]
    if len(gemms) != 1 or {a.name: a.i for a in gemms[0].attribute}.get("transB") != 1 or len(gemms[0].input) != 2:
        raise GlanceError("the vocab graph's LM head is not one bias-free Gemm with transB=1; re-export the artifacts")
    gemm = gemms[0]
    weight = _initializers(graph)[gemm.input[1]]
    transposed = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T), f"{weight.name}.T")
    graph.initializer.append(transposed)
    index = list(graph.node).index(gemm)
    graph.node.remove(gemm)
    graph.node.insert(index, helper.make_node("MatMul", [gemm.input[0], transposed.name], list(gemm.output),
                                              name="lm_head_matmul"))
    return weight.name, transposed.name


def _embedding_blocks(weight: np.ndarray, scheme: Scheme) -> tuple[np.ndarray, np.ndarray]:
    """An untied embedding [V, H] quantized by the same library routine, in MatMulNBits layout."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=scheme.group_size, is_symmetric=True, bits=scheme.bits)
    packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(weight.T))
    return packed, scales


def _gather_block_quantized(graph: onnx.GraphProto, table: str, packed: str, scales: str, hidden: int,
                            scheme: Scheme) -> int:
    """Every Gather on `table` -> GatherBlockQuantized on the packed rows, reshaped to [..., H]. Returns the count."""
    lifted = f"{scales}_blocks"  # [V, blocks, 1]: the rank GatherBlockQuantized wants for [V, blocks, blob] data
    nodes, count = [], 0
    for node in graph.node:
        if node.op_type != "Gather" or node.input[0] != table:
            nodes.append(node)
            continue
        if count == 0:
            nodes.append(helper.make_node("Unsqueeze", [scales, "embed_scale_axis"], [lifted], name="embed_scales"))
        ids, out, tag = node.input[1], node.output[0], f"embed_{count}"
        nodes += [helper.make_node("GatherBlockQuantized", [packed, ids, lifted], [f"{tag}_blocks"], domain=_MS,
                                   bits=scheme.bits, block_size=scheme.group_size, gather_axis=0, quantize_axis=2,
                                   name=f"{tag}_gather"),
                  helper.make_node("Shape", [ids], [f"{tag}_ids_shape"], name=f"{tag}_shape"),
                  helper.make_node("Concat", [f"{tag}_ids_shape", "embed_width"], [f"{tag}_shape"], axis=0,
                                   name=f"{tag}_concat"),
                  helper.make_node("Reshape", [f"{tag}_blocks", f"{tag}_shape"], [out], name=f"{tag}_reshape")]
        count += 1
    graph.initializer.extend([numpy_helper.from_array(np.array([2], np.int64), "embed_scale_axis"),
                              numpy_helper.from_array(np.array([hidden], np.int64), "embed_width")])
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def _unpack(packed: np.ndarray, bits: int, k: int) -> np.ndarray:
    """[N, blocks, blob] uint8 (low bits first) -> [N, K] unsigned values."""
    flat = packed.reshape(packed.shape[0], -1)
    if bits == 4:
        flat = np.stack([flat & 0x0F, flat >> 4], axis=-1).reshape(flat.shape[0], -1)
    return flat[:, :k]


def _ort_form(model: onnx.ModelProto, graph_name: str, scheme: Scheme) -> tuple[onnx.ModelProto, dict[str, Blocks], dict]:
    """The ONNX Runtime form of one graph, the blocks of every quantized weight (by its fp32 initializer's
    name, in MatMulNBits row order) and what was quantized (op counts; tied for the vocab graph)."""
    head, head_t, table = None, None, None
    if graph_name == "vocab":
        head, head_t = _lm_head_as_matmul(model)
        tables = {n.input[0] for n in model.graph.node if n.op_type == "Gather"} & set(_initializers(model.graph))
        if len(tables) != 1:
            raise GlanceError("the vocab graph does not read one embedding table; re-export the artifacts")
        table = tables.pop()
    quantizer = _quantizer(model, scheme)
    quantizer.process()
    out = _one_tensor_per_name(quantizer.model.model)
    inits = _initializers(out.graph)
    blocks = {}
    for node in out.graph.node:
        if node.op_type == "MatMulNBits" and node.input[1].removesuffix(f"_Q{scheme.bits}") not in blocks:
            name = node.input[1].removesuffix(f"_Q{scheme.bits}")
            k = {a.name: a.i for a in node.attribute}["K"]
            blocks[name] = Blocks(_unpack(numpy_helper.to_array(inits[node.input[1]]), scheme.bits, k),
                                  numpy_helper.to_array(inits[node.input[2]]))
    record: dict[str, Any] = {"MatMulNBits": len(blocks)}
    if graph_name != "vocab":
        return out, blocks, record
    blocks[head] = blocks.pop(head_t)  # the TensorRT form keeps W as [V, H]: MatMulNBits' row order
    if table == head:  # tied: the LM head's quantized rows serve the embedding too
        packed, scales = f"{head_t}_Q{scheme.bits}", f"{head_t}_scales"
    else:
        weight = numpy_helper.to_array(inits[table])
        packed_rows, row_scales = _embedding_blocks(weight, scheme)
        packed, scales = f"{table}_Q{scheme.bits}", f"{table}_scales"
        out.graph.initializer.extend([numpy_helper.from_array(packed_rows, packed),
                                      numpy_helper.from_array(row_scales, scales)])
        blocks[table] = Blocks(_unpack(packed_rows, scheme.bits, weight.shape[1]), row_scales)
    hidden = blocks[head].q.shape[1]
    record["GatherBlockQuantized"] = _gather_block_quantized(out.graph, table, packed, scales, hidden, scheme)
    record["tied"] = table == head
    used = {i for n in out.graph.node for i in n.input}
    keep = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    return out, blocks, record


def _dequantized(name: str, blocks: Blocks, bits: int, group: int, axis: int) -> list[onnx.TensorProto]:
    """Signed integers and scales of one weight, for a blocked DequantizeLinear that rebuilds it.

    axis 0: the weight is MatMul's B [K, N]; axis 1: a vocabulary matrix [V, H]."""
    signed, scales = _positive(blocks, bits, group)
    data, scales = (signed.T, scales.T) if axis == 0 else (signed, scales)
    kind = onnx.TensorProto.INT4 if bits == 4 else onnx.TensorProto.INT8
    values = np.ascontiguousarray(data).astype(np.int8)
    payload = values.tobytes() if bits == 8 else _pack_int4(values)
    return [helper.make_tensor(f"{name}_q{bits}", kind, list(values.shape), payload, raw=True),
            numpy_helper.from_array(np.ascontiguousarray(scales), f"{name}_scale")]


def _positive(blocks: Blocks, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed values and scales with every scale >= 0, as TensorRT requires.

    ONNX Runtime's symmetric quantizer gives a block the sign of its largest-magnitude weight, mapped to
    -2^(bits-1); such blocks are negated, and that one value, now 2^(bits-1), is clipped to 2^(bits-1) - 1."""
    half = 1 << (bits - 1)
    signed = blocks.q.astype(np.int16) - half
    flip = np.repeat(np.where(blocks.scales < 0, -1, 1), group, axis=1)[:, :signed.shape[1]].astype(np.int16)
    return np.clip(signed * flip, -half, half - 1), np.abs(blocks.scales)


def _pack_int4(values: np.ndarray) -> bytes:
    """Signed 4-bit values, two per byte, first in the low nibble (ONNX's int4 layout)."""
    flat = (values.ravel() & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def _tensorrt_form(model: onnx.ModelProto, graph_name: str, blocks: dict[str, Blocks],
                   scheme: Scheme) -> tuple[onnx.ModelProto, list[str]]:
    """The fp32 graph with each quantized initializer replaced by blocked DequantizeLinear nodes of the same
    integers, one node per reader, all reading the one stored tensor (a tied matrix is still stored once).

    A MatMul weight read by two MatMuls (the head's K/V projections, applied to context and block) stays
    fp32 here: TensorRT-RTX 1.7's compiler fails with an internal error on the draft graph when those are
    dequantized. Returns the graph and the names left fp32."""
    model = _at_opset(model, TENSORRT_OPSET)
    graph = model.graph
    axis = 1 if graph_name == "vocab" else 0  # vocabulary matrices are [V, H]; MatMul weights are [K, N]
    readers = Counter(name for node in graph.node for name in node.input)
    kept = sorted(name for name in blocks if graph_name != "vocab" and readers[name] > 1)
    tensors = {}
    for tensor in list(graph.initializer):
        if tensor.name in blocks and tensor.name not in kept:
            tensors[tensor.name] = _dequantized(tensor.name, blocks[tensor.name], scheme.bits, scheme.group_size, axis)
            graph.initializer.remove(tensor)
    nodes = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in tensors:
                data, scale = tensors[name]
                node.input[i] = f"{name}_dq{len(nodes)}"
                nodes.append(helper.make_node("DequantizeLinear", [data.name, scale.name], [node.input[i]],
                                              axis=axis, block_size=scheme.group_size, name=f"{node.input[i]}_node"))
        nodes.append(node)
    graph.initializer.extend(t for pair in tensors.values() for t in pair)
    del graph.node[:]
    graph.node.extend(nodes)
    return model, kept


def _at_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
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


def _save(model: onnx.ModelProto, path: Path) -> str | None:
    """Save a graph; its weights go to `<name>.data` beside it when it is large. Returns that file's name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(f"{path.name}.data")
    data.unlink(missing_ok=True)
    if model.ByteSize() < EXTERNAL_BYTES:
        onnx.save_model(model, str(path))
        return None
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return data.name


def quantize_graphs(out: Path, scheme: Scheme, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Rewrite target, draft and vocab graphs in `out` to the ONNX Runtime form and write their TensorRT form
    under `out/tensorrt/`; returns the manifest's "quantization" record."""
    graphs: dict[str, Any] = {}
    for name in GRAPHS:
        path = out / f"{name}.onnx"
        fp32 = _skip_weight_identities(onnx.load(str(path)))
        ort_model, blocks, record = _ort_form(_skip_weight_identities(onnx.load(str(path))), name, scheme)
        if not blocks:
            raise GlanceError(f"the {name} graph has no constant MatMul weights to quantize; re-export the artifacts")
        data = _save(ort_model, path)
        trt_path = out / TENSORRT_DIR / path.name
        trt_model, trt_fp32 = _tensorrt_form(fp32, name, blocks, scheme)
        trt_data = _save(trt_model, trt_path)
        onnx.checker.check_model(str(trt_path))
        graphs[name] = {**record, "file": path.name, "data_file": data, "tensorrt_fp32_weights": len(trt_fp32),
                        "tensorrt_file": f"{TENSORRT_DIR}/{trt_path.name}",
                        "tensorrt_data_file": f"{TENSORRT_DIR}/{trt_data}" if trt_data else None}
        progress(f"quantized {name}.onnx to {scheme.name} (group {scheme.group_size}): "
                 f"{', '.join(f'{k} {v}' for k, v in record.items() if k != 'tied')}; "
                 f"{path.stat().st_size / 1e6:.1f} MB, TensorRT form {trt_path.stat().st_size / 1e6:.1f} MB")
    return {
        "scheme": scheme.name, "bits": scheme.bits, "group_size": scheme.group_size, "symmetric": True,
        "method": "round-to-nearest, block-wise along the input axis, one fp32 scale per group",
        "library": "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer",
        "library_version": importlib.metadata.version("onnxruntime"),
        "graphs": graphs,
        "accuracy_level": None,
        "kept": "vision tower, norms, biases, rotary tables and all activations stay fp32",
        "onnxruntime_form": "MatMulNBits (linear layers and LM head) + GatherBlockQuantized (embedding)",
        "tensorrt_form": f"blocked DequantizeLinear (opset {TENSORRT_OPSET}, zero point 0) -> MatMul/Gemm/Gather",
        "tensorrt_opset": TENSORRT_OPSET,
    }
