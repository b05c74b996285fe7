"""Export one wrapped graph to ONNX with the TorchScript exporter, then prove the file well-formed.

TorchScript (`dynamo=False`) traces these wrappers in about a second and emits plain opset-17 ops
(MatMul/Softmax/Add attention) that TensorRT 10.3 parses. Opset 23 is an option for newer runtimes:
the dynamo exporter (about 20 s a graph) turns the model's sdpa attention into the ONNX Attention op.
Graphs whose weights approach 2 GB keep them in one external data file (`<graph>.onnx.data`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx.external_data_helper import convert_model_to_external_data, uses_external_data
from torch import nn

from .external_data import gather_external_data, graph_tensors
from .rewrite import gemm_for_transposed_weights

EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's hard limit is 2 GiB; stay clear of it
ATTENTION_OPSET = 23  # ONNX Attention (and RMSNormalization, RotaryEmbedding) need opset 23 and TensorRT 10.14+


def weight_bytes(module: nn.Module) -> int:
    seen = {id(p): p for p in list(module.parameters()) + list(module.buffers())}
    return sum(p.numel() * p.element_size() for p in seen.values())


def torch_args(module: nn.Module, feed: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in module.input_names)


def _dynamo_shapes(names: list[str], axes: dict[str, dict[int, str]]) -> tuple:
    """torch.export dims for `forward(*inputs)`: one named Dim per contract letter, shared across inputs."""
    from torch.export import Dim

    symbols: dict[str, Dim] = {}
    shapes = [{i: symbols.setdefault(a, Dim(a, min=0, max=1 << 20)) for i, a in axes[n].items()} if n in axes else None
              for n in names]
    return (tuple(shapes),)


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


def _torch_export(module: nn.Module, feed: dict[str, np.ndarray], path: Path, axes: dict, opset: int,
                  fold: bool) -> None:
    """TorchScript up to opset 20; the dynamo exporter from opset 23, which emits the ONNX Attention op."""
    names = dict(input_names=module.input_names, output_names=module.output_names, opset_version=opset)
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet("torch.onnx"):
        warnings.simplefilter("ignore")  # tracer warnings about Python ints are expected and checked by validation
        if opset >= ATTENTION_OPSET:
            torch.onnx.export(module, torch_args(module, feed), str(path), dynamo=True, verbose=False,
                              dynamic_shapes=_dynamo_shapes(module.input_names, axes), optimize=fold, **names)
        else:
            torch.onnx.export(module, torch_args(module, feed), str(path), dynamo=False, dynamic_axes=axes,
                              do_constant_folding=fold, **names)


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
                 output_shapes: dict[str, list[int | str]], fold_constants: bool = True) -> Path:
    """Trace `module` on `feed` into `path`; checker (full, with strict shape inference) must pass.

    `fold_constants=False` keeps weight transposes as nodes, for `gemm_for_transposed_weights` to
    turn into Gemms on the stored weight (the vocab graph: one copy of a possibly tied matrix)."""
    scratch = Path(tempfile.mkdtemp(prefix=".scratch.", dir=path.parent))
    try:
        _torch_export(module, feed, scratch / path.name, axes, opset, fold_constants)
        model = onnx.load(str(scratch / path.name), load_external_data=False)
        gemm_for_transposed_weights(model)
        pin_outputs(model, output_shapes)
        external = any(uses_external_data(t) for t in graph_tensors(model.graph))
        if not external and weight_bytes(module) >= EXTERNAL_DATA_BYTES:
            convert_model_to_external_data(model, all_tensors_to_one_file=False, size_threshold=1024)
            onnx.save_model(model, str(scratch / path.name))  # writes one file per tensor, like the exporter
            external = True
        if external:
            gather_external_data(model, scratch, path)
        else:
            onnx.save_model(model, str(path))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    onnx.checker.check_model(str(path), full_check=True)
    return path

