"""Trace a graph module with every parameter, buffer and input on the `meta` device.

The tracer only needs shapes and dtypes; on `meta` every op computes its output's shape and nothing
else, so a full-depth trace costs neither the weights' memory nor their arithmetic (CPU fp16 matmuls
over a 150k-row vocabulary are what made tracing slow). One exception: the meta kernels of
convolutions check shapes with Python conditions that the tracer turns into tensors, so a module
with a convolution (the vision towers' patch embedding) is traced on the CPU instead, each weight a
zero broadcast to its shape (a view without storage; each op materialises only its own operand).
Nothing is read from the weights' values:
the TorchScript exporter is told to keep parameters as graph inputs (`keep_initializers_as_inputs`,
which also skips its value-comparing deduplication of initializers), and buffers that the model does
not save (rotary frequency tables) are declared persistent for the trace so they arrive as graph
inputs too, instead of constants whose values a meta tensor does not have. `stream.py` then turns
every such input into an initializer written from the real tensor.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def trace_device(module: nn.Module) -> str:
    return "cpu" if any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules()) else "meta"


def _stand_in(tensor: torch.Tensor, device: str) -> torch.Tensor:
    if device == "meta":
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    elif isinstance(tensor, nn.Parameter) or tensor.is_meta:
        empty = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
    else:
        return tensor  # a real buffer is cheap and already on the CPU
    return nn.Parameter(empty, requires_grad=False) if isinstance(tensor, nn.Parameter) else empty


@contextlib.contextmanager
def weightless(module: nn.Module, device: str) -> Iterator[None]:
    """Every parameter (and, on meta, every buffer) of `module` replaced by a stand-in without storage
    (shared ones stay shared), all buffers persistent; the real tensors are back in place afterwards."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    metas: dict[int, torch.Tensor] = {}
    hidden: list[tuple[nn.Module, set[str]]] = []
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in metas:
                    metas[id(tensor)] = _stand_in(tensor, device)
                swapped.append((table, name, tensor))
                table[name] = metas[id(tensor)]
        if owner._non_persistent_buffers_set:
            hidden.append((owner, set(owner._non_persistent_buffers_set)))
            owner._non_persistent_buffers_set.clear()
    try:
        yield
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor
        for owner, names in hidden:
            owner._non_persistent_buffers_set.update(names)


def trace_args(args: tuple[torch.Tensor, ...], device: str) -> tuple[torch.Tensor, ...]:
    return tuple(a.to(device) for a in args)
