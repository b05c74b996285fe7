"""One graph's two quantized forms, written tensor by tensor from a source of fp32 weights.

The source is either an fp32 graph's stored bytes (`Fp32Graph`: each weight read from its data file by
offset and length, positioned reads, not a memory map: every touched page of a map stays resident until
it is unmapped) or the trace's weights still to be written (`quant_export.Streamed`: each read from the
snapshot, so no fp32 graph is written at all). Each weight is quantized and its tensors appended to both
forms' data files before the next is read. A MatMul weight ([K, N], one
layer's projection) is done whole; a vocabulary matrix [V, H] goes in chunks of rows, since its
MatMulNBits rows and its TensorRT [V, H] integers are both contiguous in V. Tensors that are not
quantized are copied through in slices. A small graph (no data file) keeps its tensors in the file; in a
graph with one, the embedding lookups then get aliases of their own (`lookup_alias`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Protocol

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from .external_data import graph_tensors
from .lookup_alias import separate_lookups
from .quant_blocks import block_quant, int_payload, positive
from .quant_nodes import Dequantized, Weight
from .quant_scheme import Scheme
from .stream import SLICE_BYTES, DataFile, Progress


class WeightRows(Protocol):
    """Where both forms' fp32 values come from."""

    external: bool  # whether the forms keep their tensors in data files

    def rows(self, name: str, start: int, stop: int) -> np.ndarray: ...  # rows [start, stop) of a 2-D weight as stored

    def copied(self, tensor: onnx.TensorProto) -> Iterable[bytes] | None: ...  # bytes of a tensor kept as it is


class Fp32Graph:
    """The fp32 graph's weights, read by offset from its data file (or from the graph itself when small)."""

    def __init__(self, path: Path, model: onnx.ModelProto, slice_bytes: int = SLICE_BYTES) -> None:
        self.dir = path.parent
        self.slice_bytes = slice_bytes
        self.tensors = {t.name: t for t in model.graph.initializer}
        self.external = any(uses_external_data(t) for t in graph_tensors(model.graph))

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a 2-D fp32 initializer."""
        tensor = self.tensors[name]
        cols = tensor.dims[1]
        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)[start:stop]
        info = ExternalDataInfo(tensor)
        values = np.fromfile(self.dir / info.location, np.float32, count=(stop - start) * cols,
                             offset=(info.offset or 0) + start * cols * 4)
        return values.reshape(stop - start, cols)

    def copied(self, tensor: onnx.TensorProto) -> Iterable[bytes] | None:
        """A tensor in the data file, as stored (None: it holds its bytes in the graph)."""
        return _stored_slices(self.dir, tensor, self.slice_bytes) if uses_external_data(tensor) else None


def _stored_slices(src_dir: Path, tensor: onnx.TensorProto, slice_bytes: int) -> Iterator[bytes]:
    """An external tensor's bytes as stored, in slices (where they are is read now, before the tensor is
    pointed at its new place)."""
    info = ExternalDataInfo(tensor)
    return _read(src_dir / info.location, info.offset or 0, info.length, slice_bytes)


def _read(path: Path, start: int, remaining: int, slice_bytes: int) -> Iterator[bytes]:
    with open(path, "rb") as src:
        src.seek(start)
        while remaining:
            chunk = src.read(min(remaining, slice_bytes))
            if not chunk:
                raise OSError(f"{path} ends before a tensor's declared length")
            remaining -= len(chunk)
            yield chunk


def _transposed(values: np.ndarray) -> np.ndarray:
    """A contiguous transpose of a 2-D array: torch's copy, several times faster than numpy's on a weight."""
    return torch.from_numpy(values if values.flags.writeable else values.copy()).t().contiguous().numpy()


def _raw(values: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(values)).cast("B")


def _write_rows(source: WeightRows, weight: Weight, ort: DataFile, ort_inits: dict, trt: DataFile, trt_inits: dict,
                dq: Dequantized, scheme: Scheme, slice_bytes: int) -> None:
    """A vocabulary matrix [V, H] in chunks of rows: both forms' packed rows are appended as they come, the
    scales (1/group of the rows' bytes) after them."""
    step = max(1, slice_bytes // (weight.k * 4))
    ort.start(ort_inits[weight.packed])
    trt.start(trt_inits[dq.data])
    scales, positives = [], []
    for start in range(0, weight.n, step):
        rows = source.rows(weight.name, start, min(weight.n, start + step))
        packed, chunk_scales = block_quant(_transposed(rows), scheme)
        ort.add(_raw(packed))
        signed, chunk_positive = positive(packed, chunk_scales, scheme.bits, weight.k)
        trt.add(int_payload(signed, scheme.bits))
        scales.append(chunk_scales)
        positives.append(chunk_positive)
    ort.finish()
    trt.finish()
    ort.write(ort_inits[weight.scales], [_raw(np.concatenate(scales))])
    trt.write(trt_inits[dq.scale], [_raw(np.concatenate(positives))])


def _write_matmul(source: WeightRows, weight: Weight, ort: DataFile, ort_inits: dict, trt: DataFile,
                  trt_inits: dict, dq: Dequantized | None, scheme: Scheme) -> None:
    """A MatMul weight [K, N], whole; its TensorRT integers and scales are stored as [K, N] and [blocks, N]."""
    packed, scales = block_quant(source.rows(weight.name, 0, weight.k), scheme)
    ort.write(ort_inits[weight.packed], [_raw(packed)])
    ort.write(ort_inits[weight.scales], [_raw(scales)])
    if dq is None:  # left fp32 in the TensorRT form, copied through with the other tensors
        return
    signed, positives = positive(packed, scales, scheme.bits, weight.k)
    del packed
    trt.write(trt_inits[dq.data], [int_payload(_transposed(signed), scheme.bits)])
    trt.write(trt_inits[dq.scale], [_raw(_transposed(positives))])


def write_forms(source: WeightRows, weights: dict[str, Weight], ort_model: onnx.ModelProto, ort_path: Path,
                trt_model: onnx.ModelProto, trt_path: Path, stubs: dict[str, Dequantized], scheme: Scheme,
                on_tensor: Progress | None = None, slice_bytes: int = SLICE_BYTES) -> None:
    """Fill and save both forms from `source`, in data files where `source.external`."""
    total = sum(w.k * w.n * 4 for w in weights.values())
    done = 0
    trt_path.parent.mkdir(parents=True, exist_ok=True)
    with DataFile(ort_path, source.external) as ort, DataFile(trt_path, source.external) as trt:
        for data, form in ((ort, ort_model), (trt, trt_model)):
            for tensor in graph_tensors(form.graph):
                parts = source.copied(tensor)
                if parts is not None:
                    data.write(tensor, parts)
        ort_inits = {t.name: t for t in ort_model.graph.initializer}
        trt_inits = {t.name: t for t in trt_model.graph.initializer}
        for weight in weights.values():
            if weight.rows:
                _write_rows(source, weight, ort, ort_inits, trt, trt_inits, stubs[weight.name], scheme, slice_bytes)
            else:
                _write_matmul(source, weight, ort, ort_inits, trt, trt_inits, stubs.get(weight.name), scheme)
            done += weight.k * weight.n * 4
            if on_tensor is not None:
                on_tensor(done, total, weight.name)
    if source.external:
        separate_lookups(ort_model)
    onnx.save_model(ort_model, str(ort_path))
    onnx.save_model(trt_model, str(trt_path))
