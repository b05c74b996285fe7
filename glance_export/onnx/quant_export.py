"""An int8/int4 export's graphs written straight to their two quantized forms from the trace.

Writing the fp32 graph first and quantizing it from its data file afterwards wrote and read back every
weight in fp32 (4 GB for eight layers at 3B width, most of the export's time). Here each weight goes
from its source (the snapshot, or the head in memory) to its blocks: read as stored, cast to fp32 and
transposed as the fp32 writer would store it (`stream.py`), quantized by the same routine, and appended
to both forms' data files before the next is read. The integers, scales, nodes and names are those the
fp32 graph's quantization gives (`quantize.py`), so the artifacts are the same; what validates them
without the fp32 graph is `quant_validate.py`.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import onnx
import torch
from torch import nn

from . import export
from .export import WeightSource, traced
from .quantize import TENSORRT_DIR, Forms, fill_forms, quantized_entry, quantized_forms, summary
from .quant_scheme import Scheme
from .stream import Pending, checked_values, tensor_slices


class Streamed:
    """The trace's weights as the quantized writer reads them: each from its source, cast and transposed as
    the fp32 graph would store it. One weight as stored is held at a time (a vocabulary matrix while its rows
    are quantized chunk by chunk). Weights are read, and cast or transposed, into two buffers kept for the
    graph: a fresh buffer per weight cost more in page faults than the copies themselves."""

    def __init__(self, pending: dict[str, Pending], real: Callable[..., torch.Tensor], external: bool) -> None:
        self.pending, self.real, self.external = pending, real, external
        self._held: tuple[str, torch.Tensor] | None = None
        self._read = bytearray()
        self._cast = torch.empty(0, dtype=torch.float32)

    def _stored(self, name: str) -> torch.Tensor:
        if self._held is None or self._held[0] != name:
            self._held = None  # the previous weight goes before the next is read
            item = self.pending[name]
            if len(self._read) < item.nbytes:
                self._read = bytearray(item.nbytes)
            values = checked_values(name, item, lambda t: self.real(t, buffer=self._read))
            self._held = (name, values.t() if item.transposed else values)
        return self._held[1]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a 2-D weight as the fp32 graph stores it (valid until the next call)."""
        rows = self._stored(name)[start:stop].detach()
        if rows.dtype == torch.float32 and rows.is_contiguous():
            return rows.numpy()
        if self._cast.numel() < rows.numel():
            self._cast = torch.empty(rows.numel(), dtype=torch.float32)
        # torch's transposing copy is several times numpy's, which the quantizer would make of a strided array
        return self._cast[:rows.numel()].view(rows.shape).copy_(rows).numpy()

    def copied(self, tensor: onnx.TensorProto) -> Iterable[bytes] | None:
        """A weight kept as it is (norms, biases, a weight TensorRT keeps fp32), in slices."""
        item = self.pending.get(tensor.name)
        if item is None or tensor.HasField("raw_data"):
            return None
        self._held = None
        return tensor_slices(checked_values(tensor.name, item, self.real), item)


@dataclass(frozen=True)
class QuantizedGraph:
    """What the export keeps of a graph written quantized: its manifest entry, and how each weight was
    stored and quantized (validation quantizes torch's copy the same way)."""

    entry: dict[str, Any]
    forms: Forms
    transposed: dict[str, bool]  # by fp32 name: stored as the transpose of the module's tensor
    reads: frozenset[str]  # the module's tensors the graph holds, by name


def export_quantized(module: nn.Module, feed: dict[str, np.ndarray], out: Path, name: str, axes: dict, opset: int,
                     output_shapes: dict[str, list[int | str]], weights: WeightSource, scheme: Scheme,
                     lm_head_gemm: bool, progress: Callable[[str], None]) -> QuantizedGraph:
    """Trace `module` and write `out/<name>.onnx` (ONNX Runtime form) and `out/tensorrt/<name>.onnx`."""
    started = time.perf_counter()
    path = out / f"{name}.onnx"
    scratch = Path(tempfile.mkdtemp(prefix=".scratch.", dir=out))
    try:
        model, pending = traced(module, feed, scratch / path.name, axes, opset, output_shapes, lm_head_gemm)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    forms = quantized_forms(model, name, scheme)
    external = sum(p.nbytes for p in pending.values()) >= export.EXTERNAL_DATA_BYTES
    trt_path = out / TENSORRT_DIR / path.name
    fill_forms(Streamed(pending, weights.real, external), forms, path, trt_path, scheme, progress, path.name)
    progress(f"exported {path.name} (opset {opset}) as {summary(out, name, forms, scheme)}, "
             f"in {time.perf_counter() - started:.1f}s; TensorRT form's checker passed")
    return QuantizedGraph(quantized_entry(name, forms, external), forms,
                          {n: pending[n].transposed for n in forms.weights}, frozenset(pending))
