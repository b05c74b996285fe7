"""Build a module without allocating (or randomly initialising) its parameters.

Loading a checkpoint into a freshly built module costs its weights twice, plus the time of random
initialisation; a module built here has meta parameters, which the loader then replaces by assignment.
Buffers (rotary tables) are still computed for real, since checkpoints do not carry them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside allocate no parameter storage; a meta parameter being shared (tied) is kept."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                 requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
