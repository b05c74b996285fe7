"""Export one wrapped graph to ONNX with the TorchScript exporter, then prove the file well-formed.

TorchScript (`dynamo=False`) traces these wrappers in about a second and emits plain opset-17 ops
(MatMul/Softmax/Add attention, each query head reading its KV head in place: `grouped_attention.py`)
that TensorRT 10.3 parses; the sizes the trace reads that are fixed are folded to constants
(`static_shapes.py`). Opset 23 is an option for newer runtimes:
the dynamo exporter (about 20 s a graph) turns the model's sdpa attention into the ONNX Attention op.
Graphs with more than `EXTERNAL_DATA_BYTES` of weights keep them in one external data file
(`<graph>.onnx.data`); smaller ones stay one self-contained file.

The TorchScript trace is weightless (`export_params=False`, everything on the meta device, see
`weightless.py`): weights are written afterwards, one tensor at a time, from the snapshot (`stream.py`),
so an export never holds the model. The dynamo exporter has no such mode; at opset 23 the graph's module gets its
real weights for the trace.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Collection, Protocol

import numpy as np
import onnx
import torch
from onnx.external_data_helper import convert_model_to_external_data, uses_external_data
from torch import nn

from .external_data import gather_external_data, graph_tensors
from .rewrite import gemm_for_transposed_weights, skip_identities
from .static_shapes import fold_static_shapes
from .weightless import meta_args, weightless
from .stream import (Pending, Progress, borrow_initializers, drop_unused, fold_transposes, inputs_to_initializers,
                     module_tensors, write_initializers)

EXTERNAL_DATA_BYTES = 16 << 20  # an embedded graph is held whole in memory, and again as it is serialized
ATTENTION_OPSET = 23  # ONNX Attention (and RMSNormalization, RotaryEmbedding) need opset 23 and TensorRT 10.14+


def weight_bytes(module: nn.Module) -> int:
    seen = {id(p): p for p in list(module.parameters()) + list(module.buffers())}
    return sum(p.numel() * p.element_size() for p in seen.values())


def torch_args(module: nn.Module, feed: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in module.input_names)


def _dynamo_shapes(module: nn.Module, names: list[str], axes: dict[str, dict[int, str]]) -> tuple:
    """torch.export dims in the structure of `forward`'s signature (named inputs, then `*inputs`): one named Dim
    per contract letter, shared across inputs."""
    from torch.export import Dim

    symbols: dict[str, Dim] = {}
    shapes = [{i: symbols.setdefault(a, Dim(a, min=0, max=1 << 20)) for i, a in axes[n].items()} if n in axes else None
              for n in names]
    params = inspect.signature(module.forward).parameters.values()
    named = sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return (*shapes[:named], tuple(shapes[named:]))
    return tuple(shapes)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Silence a logger's warnings for the duration (the dynamo exporter logs per skipped op library)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class WeightSource(Protocol):
    """Where a graph's weights come from when it is written (see `skeleton.Skeleton`)."""

    def real(self, tensor: torch.Tensor, buffer: bytearray | None = None) -> torch.Tensor: ...  # values as stored
    # (the writer casts them), read into `buffer` where the source reads and it is large enough

    def materialized(self, module: nn.Module, names: Collection[str] | None = None
                     ) -> contextlib.AbstractContextManager: ...  # `names`: only those weights needed


class InMemory:
    """A module whose weights are real already (the draft head)."""

    @staticmethod
    def real(tensor: torch.Tensor, buffer: bytearray | None = None) -> torch.Tensor:
        return tensor

    @staticmethod
    def materialized(module: nn.Module, names: Collection[str] | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(module)


def _torch_export(module: nn.Module, feed: dict[str, np.ndarray], path: Path, axes: dict, opset: int,
                  fold: bool = True) -> None:
    """TorchScript up to opset 20, on meta (parameters and buffers become graph inputs, nothing folded);
    the dynamo exporter from opset 23, which emits the ONNX Attention op and needs the real weights."""
    names = dict(input_names=module.input_names, output_names=module.output_names, opset_version=opset)
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet("torch.onnx"):
        warnings.simplefilter("ignore")  # tracer warnings about Python ints are expected and checked by validation
        if opset >= ATTENTION_OPSET:
            torch.onnx.export(module, torch_args(module, feed), str(path), dynamo=True, verbose=False,
                              dynamic_shapes=_dynamo_shapes(module, module.input_names, axes), optimize=fold, **names)
        else:
            with weightless(module):
                torch.onnx.export(module, meta_args(torch_args(module, feed)), str(path), dynamo=False,
                                  dynamic_axes=axes, export_params=False, keep_initializers_as_inputs=True,
                                  do_constant_folding=False, **names)


def pin_outputs(model: onnx.ModelProto, shapes: dict[str, list[int | str]]) -> None:
    """Declare each output's shape: static sizes as values, symbolic axes by their contract letter."""
    for value in model.graph.output:
        dims = value.type.tensor_type.shape.dim
        for dim, size in zip(dims, shapes[value.name]):
            if isinstance(size, int):
                dim.dim_value = size
            else:
                dim.dim_param = size


def export_graph(module: nn.Module, feed: dict[str, np.ndarray], path: Path, axes: dict, opset: int,
                 output_shapes: dict[str, list[int | str]], weights: WeightSource, lm_head_gemm: bool = False,
                 on_tensor: Progress | None = None, borrow: Path | None = None) -> Path:
    """Trace `module` on `feed` into `path`, its weights streamed from `weights`; the checker (full, with
    strict shape inference) must pass.

    `borrow`: a graph beside `path` whose data file already holds every weight of this one (the full
    target, for its depth cut); the new graph points into that file and writes no weights.

    Weight transposes are stored pre-transposed, as constant folding would; `lm_head_gemm` instead turns
    `hidden @ W.T` into a Gemm on W (the vocab graph: one copy of a possibly tied matrix)."""
    scratch = Path(tempfile.mkdtemp(prefix=".scratch.", dir=path.parent))
    try:
        if opset >= ATTENTION_OPSET:
            with weights.materialized(module):
                _torch_export(module, feed, scratch / path.name, axes, opset, fold=not lm_head_gemm)
            _finish_dynamo(scratch, path, output_shapes, weight_bytes(module))
        else:
            model, pending = traced(module, feed, scratch / path.name, axes, opset, output_shapes, lm_head_gemm)
            if borrow is not None:
                borrow_initializers(model, pending, borrow)
                onnx.save_model(model, str(path))
            else:
                external = sum(p.nbytes for p in pending.values()) >= EXTERNAL_DATA_BYTES
                write_initializers(model, pending, path, weights.real, external, on_tensor)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    onnx.checker.check_model(str(path), full_check=True)
    return path


def traced(module: nn.Module, feed: dict[str, np.ndarray], scratch: Path, axes: dict, opset: int,
           output_shapes: dict[str, list[int | str]], lm_head_gemm: bool = False
           ) -> tuple[onnx.ModelProto, dict[str, Pending]]:
    """The TorchScript trace of `module` (written at `scratch`, then read back) with its weights as initializer
    stubs still to be written, rewritten as `export_graph` describes: what either writer (fp32 or quantized) fills."""
    _torch_export(module, feed, scratch, axes, opset)
    model = onnx.load(str(scratch))
    pending = inputs_to_initializers(model, module.input_names, module_tensors(module))
    skip_identities(model, pending)
    if lm_head_gemm:
        gemm_for_transposed_weights(model)
    fold_transposes(model, pending)
    drop_unused(model, pending)
    pin_outputs(model, output_shapes)
    fold_static_shapes(model)
    return model, pending


def _finish_dynamo(scratch: Path, path: Path, output_shapes: dict[str, list[int | str]], nbytes: int) -> None:
    """Pin the dynamo export's outputs and gather its weights into one data file when they are large."""
    model = onnx.load(str(scratch / path.name), load_external_data=False)
    gemm_for_transposed_weights(model)
    pin_outputs(model, output_shapes)
    external = any(uses_external_data(t) for t in graph_tensors(model.graph))
    if not external and nbytes >= EXTERNAL_DATA_BYTES:
        convert_model_to_external_data(model, all_tensors_to_one_file=False, size_threshold=1024)
        onnx.save_model(model, str(scratch / path.name))  # one file per tensor, gathered below
        external = True
    if external:
        gather_external_data(model, scratch, path)
    else:
        onnx.save_model(model, str(path))
