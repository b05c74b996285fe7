"""Validation of graphs written quantized (`quant_export.py`), where no fp32 graph exists to compare with torch.

Each quantized graph is compared with its torch wrapper holding the same quantized weights:
- every weight the graph quantizes is read back from the written graph (its packed blocks and scales),
  multiplied back out, and refused unless each value lies within one quantization step of the snapshot's
  (`dequantize`: a wrong, misplaced or corrupt block fails here, by name); torch's module then computes
  with those values in place of the real weights, every other weight as stored;
- ONNX Runtime runs the written graph with its MatMulNBits computing in fp32 (a copy of the graph file
  without `accuracy_level`, naming the same data file: the default's int8 activations are ONNX Runtime's
  arithmetic, not the graph's), so both sides multiply the same numbers and must agree to the fp32
  tolerance, top-k ids wherever the margin is clear: a wrong node, wire or layout fails here;
- the target: whole when small; otherwise, as for fp32 exports (`depth_cut.py`), the full graph as written
  is smoke-run at full depth, and its `CUT_LAYERS`-layer cut, traced by the same code and rewritten to the
  same quantized form, reads the full graph's own data file, so both checks cover those layers' bytes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import TARGET_GRAPH

from . import depth_cut
from .depth_cut import CUT_LAYERS, cut_dims, external, smoke_run
from .export import traced, weight_bytes
from .feeds import trace_feeds
from .quant_export import QuantizedGraph, export_quantized
from .quant_nodes import Weight
from .quant_scheme import Scheme
from .quantize import quantized_forms
from .sources import target_graph, target_skeleton
from .spec import DTYPES, Dims, dynamic_axes, output_shapes
from .stream import borrow_initializers, module_tensors
from .validate import ID_OUTPUTS, TOLERANCES, validate_graph, validation_feeds

EXACT = "exact"
DEQUANT_ROWS = 2048  # rows multiplied back out and checked at once (16 MB of buffers at 2048 wide)


def _stored_blocks(out: Path, graph: QuantizedGraph, weight: Weight) -> tuple[np.ndarray, np.ndarray]:
    """A weight's packed blocks and scales as the graph file stores them (in its data file, or in it)."""
    tensors = {t.name: t for t in graph.forms.ort_model.graph.initializer}
    return tuple(numpy_helper.to_array(tensors[n], base_dir=str(out)) for n in (weight.packed, weight.scales))


def dequantize(graph_name: str, values: torch.Tensor, transposed: bool, weight: Weight, packed: np.ndarray,
               scales: np.ndarray, scheme: Scheme, in_place: bool) -> torch.Tensor:
    """A module's tensor as its graph holds it, multiplied back out of the stored blocks; refused unless every
    value is within one quantization step of the tensor's own (a block's value of the opposite sign to its
    largest is clipped by up to a step; any other tensor's values, or these misplaced, are several steps off).
    `in_place`: overwrite `values` (a copy made for validation) rather than fill a new tensor. Rows go
    `DEQUANT_ROWS` at a time through buffers made once, so no step maps fresh pages."""
    out = values if in_place else torch.empty(values.shape, dtype=torch.float32)
    views = [t.t() if transposed else t for t in (values, out)]  # as stored
    source, target = [v if weight.rows else v.t() for v in views]  # [N, K]
    n, k = source.shape
    blocks, group = scales.shape[1], scheme.group_size
    half = np.float32(1 << (scheme.bits - 1))
    step = min(n, DEQUANT_ROWS)
    steps = np.empty((step, blocks, group), np.uint8)
    work, back = np.empty((step, blocks, group), np.float32), np.empty((step, blocks * group), np.float32)
    far = np.empty((step, blocks, group), bool)
    for start in range(0, n, step):
        m = min(step, n - start)
        rows = packed[start:start + m]
        if scheme.bits == 4:
            np.bitwise_and(rows, 0x0F, out=steps[:m, :, 0::2])
            np.right_shift(rows, 4, out=steps[:m, :, 1::2])
        else:
            steps[:m] = rows
        scale = scales[start:start + m, :, None]
        np.subtract(steps[:m], half, out=work[:m], dtype=np.float32)
        np.multiply(work[:m], scale, out=work[:m])
        back[:m, :k] = source[start:start + m].numpy()
        np.subtract(work[:m], back[:m].reshape(m, blocks, group), out=back[:m].reshape(m, blocks, group))
        np.abs(back[:m], out=back[:m])
        np.greater(back[:m].reshape(m, blocks, group), np.abs(scale) * np.float32(1 + 1e-6), out=far[:m])
        if far[:m].reshape(m, -1)[:, :k].any():
            raise GlanceError(f"{graph_name} graph: quantized weight {weight.name} is more than one step from the "
                              "source's values; export the artifacts again")
        target[start:start + m] = torch.from_numpy(work[:m].reshape(m, -1)[:, :k])
    return out


@contextlib.contextmanager
def dequantized(module: nn.Module, materialized: Callable[..., ContextManager], graph_name: str,
                graph: QuantizedGraph, out: Path, scheme: Scheme) -> Iterator[nn.Module]:
    """`module` with the real weights its graph reads (`materialized(module, names)`, as `Skeleton.materialized`),
    those the graph quantizes replaced by the graph file's own blocks multiplied back out (each checked against
    the real weight), for the duration. A weight read in for the check (a meta one) is overwritten in place;
    one the module holds (the head's) is left as it is."""
    fresh = {name for name, tensor in module_tensors(module).items() if tensor.is_meta}
    with materialized(module, graph.reads):
        tensors = module_tensors(module)
        done: set[int] = set()
        values: dict[int, torch.Tensor] = {}  # new tensors for weights the module holds
        for name, weight in graph.forms.weights.items():
            tensor = tensors[name]
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            result = dequantize(graph_name, tensor.detach(), graph.transposed[name], weight,
                                *_stored_blocks(out, graph, weight), scheme, in_place=name in fresh)
            if name not in fresh:
                values[id(tensor)] = result
        swapped = []
        for owner in module.modules():
            for slots, wrap in ((owner._parameters, lambda t: nn.Parameter(t, requires_grad=False)),
                                (owner._buffers, lambda t: t)):
                for key, value in list(slots.items()):
                    if value is not None and id(value) in values:
                        swapped.append((slots, key, value))
                        slots[key] = wrap(values[id(value)])
        try:
            yield module
        finally:
            for slots, key, value in swapped:
                slots[key] = value


@contextlib.contextmanager
def exact_graph(path: Path) -> Iterator[Path]:
    """The graph at `path` with every MatMulNBits computing in fp32, as a file beside it (same data file)."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"
             and any(a.name == "accuracy_level" for a in n.attribute)]
    if not nodes:
        yield path
        return
    for node in nodes:
        kept = [a for a in node.attribute if a.name != "accuracy_level"]
        del node.attribute[:]
        node.attribute.extend(kept)
    copy = path.with_name(f".exact.{path.name}")
    onnx.save_model(model, str(copy))
    try:
        yield copy
    finally:
        copy.unlink(missing_ok=True)


def validate_quantized_graph(name: str, path: Path, module: nn.Module, graph: QuantizedGraph, feeds: list[dict],
                             materialized: Callable[..., ContextManager], scheme: Scheme) -> dict[str, float]:
    """Max error per output of the quantized graph at `path` against torch holding the same quantized weights."""
    with exact_graph(path) as exact:
        return validate_graph(name, exact, module, feeds, TOLERANCES["fp32"],
                              lambda m: dequantized(m, materialized, name, graph, path.parent, scheme))


def _cut(out: Path, module: nn.Module, cut, small: Dims, snapshot, opset: int, branch_k: int, scheme: Scheme,
         seed: int) -> tuple[dict[str, float], bool]:
    """The cut's errors, and whether it read the full target's data file (else, a small full graph keeping its
    tensors inside, the cut is written quantized on its own)."""
    axes = dynamic_axes(small, "target", module.input_names, module.output_names)
    feed = trace_feeds(snapshot, small, DTYPES["fp32"])["target"]
    shapes = output_shapes(small, "target", branch_k)
    feeds = validation_feeds("target", small, snapshot, "fp32", seed)
    exact = dataclasses.replace(scheme, accuracy=EXACT)
    scratch = Path(tempfile.mkdtemp(prefix=".cut.", dir=out))
    try:
        full = out / TARGET_GRAPH
        if not external(full):
            graph = export_quantized(module, feed, scratch, "target", axes, opset, shapes, cut, exact, False,
                                     lambda _: None)
            return validate_quantized_graph("target", scratch / TARGET_GRAPH, module, graph, feeds,
                                            cut.materialized, exact), False
        model, pending = traced(module, feed, scratch / TARGET_GRAPH, axes, opset, shapes)
        forms = quantized_forms(model, "target", exact)
        stubs = set(pending) | {n for w in forms.weights.values() for n in (w.packed, w.scales)}
        borrow_initializers(forms.ort_model, stubs, full)
        path = out / f"{scratch.name}.{TARGET_GRAPH}"  # beside the data file it reads
        onnx.save_model(forms.ort_model, str(path))
        graph = QuantizedGraph({}, forms, {n: pending[n].transposed for n in forms.weights}, frozenset(pending))
        try:
            return validate_graph("target", path, module, feeds, TOLERANCES["fp32"],
                                  lambda m: dequantized(m, cut.materialized, "target", graph, out, exact)), True
        finally:
            path.unlink(missing_ok=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def validate_quantized_target(out: Path, full: nn.Module, graph: QuantizedGraph, skeleton, dims: Dims, snapshot,
                              opset: int, attention: str, branch_k: int, scheme: Scheme, seed: int,
                              progress: Callable[[str], None]) -> dict[str, float]:
    """The quantized target whole when small, else as `validate_quantized_cut`."""
    if weight_bytes(full) <= depth_cut.FULL_VALIDATION_BYTES or dims.layers <= CUT_LAYERS:
        return validate_quantized_graph("target", out / TARGET_GRAPH, full, graph,
                                        validation_feeds("target", dims, snapshot, "fp32", seed),
                                        skeleton.materialized, scheme)
    return validate_quantized_cut(out, skeleton, dims, snapshot, opset, attention, branch_k, scheme, seed, progress)


def validate_quantized_cut(out: Path, skeleton, dims: Dims, snapshot, opset: int, attention: str, branch_k: int,
                           scheme: Scheme, seed: int, progress: Callable[[str], None]) -> dict[str, float]:
    """The written target smoke-run at full depth (int8 activations where it has them), then its depth cut,
    reading the full graph's blocks where it keeps them in a data file, against torch."""
    path = out / TARGET_GRAPH
    small = cut_dims(dims, CUT_LAYERS)
    cut = target_skeleton(snapshot, skeleton.checkpoint, "fp32", attention, layers=CUT_LAYERS)
    module = target_graph(cut.model, small)
    progress(f"smoke-running all {dims.layers} layers of {path.name} ({scheme.name}, as written) in ONNX Runtime")
    smoke_run(path, dims, "fp32", seed, budget=weight_bytes(module), prepack=True)
    errors, borrowed = _cut(out, module, cut, small, snapshot, opset, branch_k, scheme, seed)
    where = f", its weights read from {TARGET_GRAPH}.data" if borrowed else ""
    progress(f"validated a {CUT_LAYERS}-layer cut of {path.name} ({scheme.name}{where}) against torch")
    return errors


def quantized_line(name: str, module: nn.Module, errors: dict[str, float], feeds: int, scheme: Scheme) -> str:
    worst = max((v for k, v in errors.items() if k not in ID_OUTPUTS), default=0.0)
    ids = ", ids identical where the margin is clear" if set(ID_OUTPUTS) & set(module.output_names) else ""
    return (f"validated {name}.onnx ({scheme.name}) in ONNX Runtime on {feeds} inputs against torch holding the same "
            f"{scheme.name} weights dequantized, MatMulNBits in fp32 (max float error {worst:.3g}{ids})")


def validate_quantized(out: Path, graphs: dict[str, nn.Module], quantized: dict[str, QuantizedGraph], skeleton,
                       dims: Dims, snapshot, opset: int, attention: str, branch_k: int, scheme: Scheme, seed: int,
                       progress: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """Every quantized graph against torch holding its quantized weights; returns max errors by graph and output."""
    report = {"target": validate_quantized_target(out, graphs["target"], quantized["target"], skeleton, dims,
                                                  snapshot, opset, attention, branch_k, scheme, seed, progress)}
    progress(quantized_line("target", graphs["target"], report["target"],
                            len(validation_feeds("target", dims, snapshot, "fp32", seed)), scheme))
    for name, graph in quantized.items():
        if name == "target":
            continue
        feeds = validation_feeds(name, dims, snapshot, "fp32", seed)
        report[name] = validate_quantized_graph(name, out / f"{name}.onnx", graphs[name], graph, feeds,
                                                skeleton.materialized, scheme)
        progress(quantized_line(name, graphs[name], report[name], len(feeds), scheme))
    return report
