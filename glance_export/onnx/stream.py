"""Turn a weightless traced graph into a complete one, writing its initializers one tensor at a time.

The graph is traced with `export_params=False`, so every parameter and buffer arrives as a graph input
named after the module attribute that holds it. Each becomes an initializer whose bytes are produced
only when it is written: the weight source reads the tensor as stored (bf16 in most snapshots), and
the writer casts it to the export's dtype, and transposes it where it is read only through `Transpose`
(what constant folding did when the weights were in memory), in slices of at most `SLICE_BYTES`,
each written straight to `<graph>.onnx.data` at a page-aligned offset (runtimes can map each tensor)
or, for a small graph, into the graph file itself, by `DataFile` (the quantizer writes through it too).
At most one tensor as stored, plus one slice, is in memory at any time.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import onnx
import torch
from onnx.external_data_helper import uses_external_data
from torch import nn

from glance_runtime.errors import GlanceError

from .external_data import ALIGN, point_external
from .rewrite import bypass

TORCH_TO_ONNX = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
                 torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
                 torch.int32: onnx.TensorProto.INT32, torch.bool: onnx.TensorProto.BOOL}


@dataclass
class Pending:
    """One initializer still to be written: the module tensor it comes from, and whether it is stored transposed."""

    tensor: torch.Tensor
    transposed: bool = False

    @property
    def shape(self) -> list[int]:
        shape = list(self.tensor.shape)
        return shape[::-1] if self.transposed else shape

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by the dotted name the TorchScript exporter gives its graph input."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return tensors


def inputs_to_initializers(model: onnx.ModelProto, user_inputs: list[str],
                           tensors: dict[str, torch.Tensor]) -> dict[str, Pending]:
    """Graph inputs past the user's become initializer stubs (name, type, shape, no data)."""
    graph = model.graph
    pending: dict[str, Pending] = {}
    keep = []
    for value in graph.input:
        if value.name in user_inputs:
            keep.append(value)
            continue
        tensor = tensors[value.name]
        pending[value.name] = Pending(tensor)
        graph.initializer.append(onnx.TensorProto(name=value.name, data_type=TORCH_TO_ONNX[tensor.dtype],
                                                  dims=list(tensor.shape)))
    del graph.input[:]
    graph.input.extend(keep)
    return pending


def fold_transposes(model: onnx.ModelProto, pending: dict[str, Pending]) -> None:
    """A 2-D weight read only through `Transpose(perm=[1, 0])` is stored transposed and read directly."""
    graph = model.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    renamed: dict[str, str] = {}
    for name, item in pending.items():
        nodes = readers.get(name, [])
        if item.tensor.dim() != 2 or not nodes or not all(_is_plain_transpose(n) for n in nodes):
            continue
        item.transposed = True
        for node in nodes:
            renamed[node.output[0]] = name
    if not renamed:
        return
    bypass(graph, renamed)
    for tensor in graph.initializer:
        if tensor.name in pending and pending[tensor.name].transposed:
            tensor.dims[:] = pending[tensor.name].shape


def _is_plain_transpose(node: onnx.NodeProto) -> bool:
    perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
    return node.op_type == "Transpose" and perm in ([], [[1, 0]])


def drop_unused(model: onnx.ModelProto, pending: dict[str, Pending]) -> None:
    """Initializers no node reads any more (a weight whose readers were all rewritten) are not written."""
    used = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    keep = [t for t in model.graph.initializer if t.name in used or t.name not in pending]
    for tensor in model.graph.initializer:
        if tensor.name not in used:
            pending.pop(tensor.name, None)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


SLICE_BYTES = 64 << 20


def _slices(values: torch.Tensor, dtype: torch.dtype, transposed: bool) -> Iterator[torch.Tensor]:
    """`values` (or its transpose) cast to dtype, in contiguous row slices of at most SLICE_BYTES."""
    out = values.t() if transposed else values
    if out.dim() == 0:
        yield out.to(dtype)
        return
    row = max(out[0].numel(), 1) * torch.empty((), dtype=dtype).element_size()
    step = max(1, SLICE_BYTES // row)
    for start in range(0, max(out.shape[0], 1), step):
        yield out[start:start + step].to(dtype, memory_format=torch.contiguous_format)  # one pass: cast and copy


def _buffer(values: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous tensor, without a copy (bf16 too, which numpy cannot name)."""
    values = values.detach().contiguous()
    if values.dtype == torch.bfloat16:
        values = values.view(torch.int16)
    return memoryview(values.numpy()).cast("B")


def checked_values(name: str, item: Pending, real: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The values behind a pending initializer, refused unless of its shape (and kind: any floating dtype for a
    floating tensor, the writer casts it)."""
    values = real(item.tensor)
    if tuple(values.shape) != tuple(item.tensor.shape) or (values.dtype != item.tensor.dtype and not (
            values.is_floating_point() and item.tensor.is_floating_point())):
        raise ValueError(f"weight source gave {values.dtype} {list(values.shape)} for {name}")
    return values


def tensor_slices(values: torch.Tensor, item: Pending) -> Iterator[memoryview]:
    """The bytes of a pending initializer as stored (cast, transposed where it is), slice by slice."""
    return (_buffer(part) for part in _slices(values, item.tensor.dtype, item.transposed))


Progress = Callable[[int, int, str], None]  # (bytes written so far, total bytes, name of the tensor just written)


class DataFile:
    """Where a graph's tensors go as they are produced: appended page-aligned to `<graph>.onnx.data` (runtimes
    can map each tensor) and the tensor pointed at its bytes, or, for a small graph, into the tensor itself.
    One tensor is open at a time; its parts are written as they come, so none is held whole."""

    def __init__(self, path: Path, external: bool) -> None:
        self.name = f"{path.name}.data"
        self._out = open(path.with_name(self.name), "wb") if external else None
        self._offset = 0
        self._open: tuple[onnx.TensorProto, int, list[bytes]] | None = None

    def __enter__(self) -> "DataFile":
        return self

    def __exit__(self, *exc) -> None:
        if self._out is not None:
            self._out.close()

    def start(self, tensor: onnx.TensorProto) -> None:
        if self._out is not None:
            pad = (-self._offset) % ALIGN
            self._offset += self._out.write(b"\0" * pad)
        self._open = (tensor, self._offset, [])

    def add(self, part) -> None:
        if self._out is not None:
            self._offset += self._out.write(part)
        else:
            self._open[2].append(bytes(part))

    def finish(self) -> None:
        tensor, start, parts = self._open
        if self._out is not None:
            point_external(tensor, self.name, start, self._offset - start)
        else:
            tensor.raw_data = b"".join(parts)
        self._open = None

    def write(self, tensor: onnx.TensorProto, parts) -> None:
        """One whole tensor from an iterable of byte buffers."""
        self.start(tensor)
        for part in parts:
            self.add(part)
        self.finish()


def write_initializers(model: onnx.ModelProto, pending: dict[str, Pending], path: Path,
                       real: Callable[[torch.Tensor], torch.Tensor], external: bool,
                       on_tensor: Progress | None = None) -> None:
    """Fill every pending initializer from `real(tensor)` (its values, in any floating dtype for a
    floating tensor) and save the graph at `path` (with `<path>.data` when external). Tensors are
    produced, written and freed one at a time."""
    total = sum(p.nbytes for p in pending.values())
    done = 0
    with DataFile(path, external) as data:
        for tensor in model.graph.initializer:
            item = pending.get(tensor.name)
            if item is None:
                continue
            data.write(tensor, tensor_slices(checked_values(tensor.name, item, real), item))
            done += item.nbytes
            if on_tensor is not None:
                on_tensor(done, total, tensor.name)
    onnx.save_model(model, str(path))


def borrow_initializers(model: onnx.ModelProto, pending: dict[str, Pending], source: Path) -> None:
    """Point every pending initializer at the tensor of the same name, type and stored shape in the data
    file of `source` (a graph in the same directory); nothing is written."""
    stored = {t.name: t for t in onnx.load(str(source), load_external_data=False).graph.initializer}
    for tensor in model.graph.initializer:
        if tensor.name not in pending:
            continue
        have = stored.get(tensor.name)
        if have is None or not uses_external_data(have) or have.data_type != tensor.data_type \
                or list(have.dims) != list(tensor.dims):
            raise GlanceError(f"{source.name} does not hold {tensor.name} as {list(tensor.dims)}; export it again")
        del tensor.external_data[:]
        tensor.external_data.extend(have.external_data)
        tensor.data_location = onnx.TensorProto.EXTERNAL


LAYER = re.compile(r"\.(?:layers|blocks)\.(\d+)\.")
QUIET_BYTES = 64 << 20  # graphs smaller than this are written too fast to need progress lines


def eta_reporter(label: str, layers: int, progress: Callable[[str], None], every_s: float = 10.0) -> Progress:
    """Lines with the layer being written, bytes, elapsed time and an ETA (by bytes written since the first
    tensor, so the trace before it does not skew the rate), at most one per `every_s` seconds and one at
    the end; none for a small graph."""
    started = time.perf_counter()
    first: list[tuple[float, int]] = []  # (time, bytes) when the first tensor was written
    last = [started]

    def report(done: int, total: int, name: str) -> None:
        now = time.perf_counter()
        if not first:
            first.append((now, done))
        if total < QUIET_BYTES or done < total and now - last[0] < every_s:
            return
        last[0] = now
        layer = LAYER.search(name)
        where = f"layer {int(layer.group(1)) + 1}/{layers}, " if layer and layers else ""
        since, base = first[0]
        rate = (done - base) / (now - since) if now > since and done > base else 0.0
        eta = f", about {(total - done) / rate:.0f}s left" if done < total and rate else ""
        progress(f"  {label}: {where}{done / 1e9:.2f} of {total / 1e9:.2f} GB written in {now - started:.0f}s{eta}")

    return report
