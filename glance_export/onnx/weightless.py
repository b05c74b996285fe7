"""Trace a graph module with every parameter, buffer and input on the `meta` device.

The tracer only needs shapes and dtypes; on `meta` every op computes its output's shape and nothing
else, so a full-depth trace costs neither the weights' memory nor their arithmetic (CPU fp16 matmuls
over a 150k-row vocabulary, and a vision tower's, are what made tracing slow). The meta kernels of
convolutions do not trace (they check shapes with Python conditions the tracer turns into tensors),
so the graph modules use none (see `VisionGraph.patch_embed`). Nothing is read from the weights' values:
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


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(empty, requires_grad=False) if isinstance(tensor, nn.Parameter) else empty


@contextlib.contextmanager
def weightless(module: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of `module` on meta (shared ones stay shared), all buffers persistent;
    the real tensors are back in place afterwards."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    metas: dict[int, torch.Tensor] = {}
    hidden: list[tuple[nn.Module, set[str]]] = []
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in metas:
                    metas[id(tensor)] = tensor if tensor.is_meta else _meta(tensor)
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


def meta_args(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(a.to("meta") for a in args)
