"""GLANCE runtime: the draft/verify loop and its backends; the ONNX Runtime path needs no torch.

The public API (`import glance_runtime as gr`) loads on first use, so importing one sub-module (say
`glance_runtime.decode.tree`) does not import the API and everything it opens (Pillow, tokenizers), and
`dir(gr)` lists only the API."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._version import __version__  # noqa: F401 (the package version, read as glance_runtime.__version__)

if TYPE_CHECKING:
    from .api import Chat, Model, Output, Stream, load
    from .errors import GlanceError, InputError, IntegrityError, LimitError

_HOMES = {"Chat": "api", "Model": "api", "Output": "api", "Stream": "api", "load": "api", "GlanceError": "errors",
          "InputError": "errors", "IntegrityError": "errors", "LimitError": "errors"}
__all__ = ["Chat", "GlanceError", "InputError", "IntegrityError", "LimitError", "Model", "Output", "Stream", "load"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
