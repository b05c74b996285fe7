"""ONNX export of the target, draft and vision graphs, with graph-level validation in ONNX Runtime.

The exporter is loaded on first use (it imports torch), so the torch-free modules here (`node_runs`, which the
build in parts shares) import on a device without the export stack."""
from __future__ import annotations

from typing import Any

__all__ = ["export_artifacts", "validate_artifacts"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import artifacts

        return getattr(artifacts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
