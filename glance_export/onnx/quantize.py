"""Weight-only int8/int4 quantization of exported graphs, in the two forms the deployment runtimes read.

Decoding on an edge device is bound by the weight bytes read per token, so the target's and the head's
linear layers and the vocabulary matrices are stored block-quantized (symmetric round-to-nearest, one
fp32 scale per `group_size` weights along the input axis); activations, norms, biases and the vision
tower stay in the export's dtype. The blocks are ONNX Runtime's own (`quant_blocks.py`), computed once
per weight; both forms are made from those integers and scales:

- ONNX Runtime form (the artifacts' graph files): `MatMulNBits` for every constant MatMul weight, the LM
  head included (its `Gemm(hidden, W, transB=1)` reads the rows of W), and `GatherBlockQuantized` for
  the embedding. MatMulNBits stores B as [N, blocks, blob] rows of W, the embedding's own layout, so a
  tied matrix stays ONE quantized tensor read by the LM head and by every embedding lookup.
- TensorRT form (`tensorrt/<graph>.onnx`): the fp32 graph with each quantized weight replaced by a
  blocked `DequantizeLinear` (opset 21, int4/int8, zero point 0) of the same integers, except that
  TensorRT needs positive scales (see `quant_blocks.positive`); a tied matrix is one DequantizeLinear
  feeding the Gather and the Gemm.

Nothing holds a graph's weights: the nodes are rewritten on the graph loaded without them
(`quant_nodes.py`), and the tensors are written one at a time (`quant_write.py`). Each fp32 graph is
deleted as soon as both of its forms are written.
"""
from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import onnx

from glance_runtime.errors import GlanceError

from .quant_nodes import TENSORRT_OPSET, Dequantized, Weight, onnxruntime_form, tensorrt_form
from .quant_scheme import Scheme, check_scheme
from .quant_write import Fp32Graph, WeightRows, write_forms
from .rewrite import skip_identities
from .stream import LAYER, SLICE_BYTES, eta_reporter

__all__ = ["GRAPHS", "TENSORRT_DIR", "check_scheme", "quantize_graph", "quantize_graphs"]

GRAPHS = ("target", "draft", "vocab")  # the vision tower runs once per image: it stays in the export's dtype
OPTIONAL_GRAPHS = ("draft_vocab",)  # where exported
TENSORRT_DIR = "tensorrt"
ACTIVATIONS_INT8 = ("int8 per block of each row (MatMulNBits accuracy_level 4) on ONNX Runtime's CPU provider: an "
                    "n-row pass may differ from a 1-row pass in the last bits")
STAGING = ".quantizing"  # each ONNX Runtime form is written here while its fp32 graph is read


@dataclass(frozen=True)
class Forms:
    """One graph's two quantized forms, weightless, and what fills them."""

    ort_model: onnx.ModelProto
    trt_model: onnx.ModelProto
    weights: dict[str, Weight]  # by fp32 name
    stubs: dict[str, Dequantized]  # the TensorRT form's tensors, by fp32 name
    kept: list[str]  # fp32 in the TensorRT form
    record: dict[str, Any]


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def quantized_forms(model: onnx.ModelProto, name: str, scheme: Scheme) -> Forms:
    """Both forms' nodes of graph `name` (`model`: its fp32 graph without weights, left as it is) and the
    weights to fill them with."""
    # every MatMul on a weight sees the initializer, so the weight is quantized once, not kept fp32 beside it
    skip_identities(model, {t.name for t in model.graph.initializer})
    ort_model = _copy(model)
    weights, record = onnxruntime_form(ort_model, name, scheme)
    if not weights:
        raise GlanceError(f"the {name} graph has no constant MatMul weights to quantize; re-export the artifacts")
    trt_model, stubs, kept = tensorrt_form(_copy(model), name, weights, scheme)
    return Forms(ort_model, trt_model, weights, stubs, kept, record)


def fill_forms(source: WeightRows, forms: Forms, ort_path: Path, trt_path: Path, scheme: Scheme,
               progress: Callable[[str], None], label: str, slice_bytes: int = SLICE_BYTES) -> None:
    """Write both forms from `source`, with progress lines by layer for a large graph."""
    layers = 1 + max((int(m.group(1)) for m in map(LAYER.search, forms.weights) if m), default=-1)
    write_forms(source, forms.weights, forms.ort_model, ort_path, forms.trt_model, trt_path, forms.stubs, scheme,
                eta_reporter(label, layers, progress), slice_bytes)
    onnx.checker.check_model(str(trt_path))


def quantized_entry(name: str, forms: Forms, external: bool) -> dict[str, Any]:
    """The graph's entry of the manifest's "quantization" record."""
    file = f"{name}.onnx"
    data, trt_data = (f"{file}.data", f"{TENSORRT_DIR}/{file}.data") if external else (None, None)
    return {**forms.record, "file": file, "data_file": data, "tensorrt_fp32_weights": len(forms.kept),
            "tensorrt_file": f"{TENSORRT_DIR}/{file}", "tensorrt_data_file": trt_data}


def summary(out: Path, name: str, forms: Forms, scheme: Scheme) -> str:
    """What the two forms of graph `name` hold, for a progress line."""
    return (f"{scheme.name} (group {scheme.group_size}): "
            f"{', '.join(f'{k} {v}' for k, v in forms.record.items() if k != 'tied')}; "
            f"{_bytes(out / f'{name}.onnx') / 1e6:.1f} MB, TensorRT form "
            f"{_bytes(out / TENSORRT_DIR / f'{name}.onnx') / 1e6:.1f} MB")


def quantize_graph(out: Path, name: str, scheme: Scheme, progress: Callable[[str], None] = print,
                   slice_bytes: int = SLICE_BYTES) -> dict[str, Any]:
    """Both forms of `out/<name>.onnx` in place of the fp32 graph; returns its entry of the manifest's record."""
    started = time.perf_counter()
    src = out / f"{name}.onnx"
    model = onnx.load(str(src), load_external_data=False)
    forms = quantized_forms(model, name, scheme)
    staged = out / STAGING / src.name
    staged.parent.mkdir(exist_ok=True)
    trt_path = out / TENSORRT_DIR / src.name
    source = Fp32Graph(src, model, slice_bytes)
    fill_forms(source, forms, staged, trt_path, scheme, progress, f"quantizing {src.name}", slice_bytes)
    for path in (src, src.with_name(f"{src.name}.data")):
        path.unlink(missing_ok=True)
    for path in (staged, staged.with_name(f"{staged.name}.data")):
        if path.exists():
            path.rename(out / path.name)
    staged.parent.rmdir()
    progress(f"quantized {src.name} to {summary(out, name, forms, scheme)}, in {time.perf_counter() - started:.1f}s")
    return quantized_entry(name, forms, source.external)


def _bytes(path: Path) -> int:
    data = path.with_name(f"{path.name}.data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def quantize_graphs(out: Path, scheme: Scheme, progress: Callable[[str], None] = print,
                    slice_bytes: int = SLICE_BYTES) -> dict[str, Any]:
    """Rewrite target, draft and vocab graphs (and draft_vocab, where exported) in `out` to the ONNX Runtime form
    and write their TensorRT form under `out/tensorrt/`; returns the manifest's "quantization" record.
    `slice_bytes` bounds the rows of a vocabulary matrix quantized at once and the slices copied through."""
    present = [name for name in OPTIONAL_GRAPHS if (out / f"{name}.onnx").exists()]
    return quantization_record(scheme, {name: quantize_graph(out, name, scheme, progress, slice_bytes)
                                        for name in [*GRAPHS, *present]})


def quantization_record(scheme: Scheme, graphs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's "quantization" record, from each quantized graph's entry."""
    return {
        "scheme": scheme.name, "bits": scheme.bits, "group_size": scheme.group_size, "symmetric": True,
        "method": "round-to-nearest, block-wise along the input axis, one fp32 scale per group",
        "library": "onnxruntime.quantization.matmul_nbits_quantizer.DefaultWeightOnlyQuantizer.qbits_block_quant",
        "equals": "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer on the whole graph, bit for bit",
        "library_version": importlib.metadata.version("onnxruntime"),
        "graphs": graphs,
        "accuracy_level": scheme.accuracy_level,
        "activations": (ACTIVATIONS_INT8 if scheme.accuracy_level else
                        "fp32: every row of an n-row pass equals that row's 1-row pass, bit for bit"),
        "kept": "vision tower, norms, biases, rotary tables and all activations stay fp32",
        "onnxruntime_form": "MatMulNBits (linear layers and LM head) + GatherBlockQuantized (embedding)",
        "tensorrt_form": f"blocked DequantizeLinear (opset {TENSORRT_OPSET}, zero point 0) -> MatMul/Gemm/Gather",
        "tensorrt_opset": TENSORRT_OPSET,
    }
