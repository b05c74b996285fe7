"""The runtime's one door up to the exporter side (torch, transformers, onnx).

An edge install runs the ONNX Runtime and TensorRT paths without torch, so no module of
`glance_runtime` imports `glance_export`; the two things that need it, the torch reference and an
on-demand export, come through here, imported on first use, with a one-line fix when the export
extra is missing.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .errors import GlanceError

if TYPE_CHECKING:
    from .runner import Runner


def torch_runner(model: Path, head: Path | None, dtype: str = "float32") -> "Runner":
    """The torch reference backend and its greedy oracle."""
    try:
        from glance_export.reference import open_reference
    except ImportError as exc:
        raise GlanceError(f"the torch backend needs the export extra ({exc.name} is missing): "
                          "pip install 'glance-toolkit[export]'") from None
    return open_reference(model, head, dtype)


def export(model: Path, head: Path, out: Path, progress: Callable[[str], None]) -> Path:
    """Export (model, head) to an artifacts directory at `out` (the runtime's export cache)."""
    try:
        from glance_export.onnx import export_artifacts
    except ImportError:
        raise GlanceError("no --artifacts given and exporting needs the export extra: "
                          "pip install 'glance-toolkit[export]', or pass --artifacts DIR") from None
    progress(f"exporting {model} + {head} to {out} (once; later runs reuse it)")
    return export_artifacts(model, head, out, progress=progress)
