"""Which weight-only schemes a device target's TensorRT runs, and the graph files it builds them from.

Quantized artifacts carry two forms of each quantized graph (see `onnx/quantize.py`): ONNX Runtime's
(MatMulNBits) under the usual names and TensorRT's (blocked DequantizeLinear, opset 21) under
`tensorrt/`. This module imports neither torch nor onnx: a Jetson builds from an export made elsewhere.
"""
from __future__ import annotations

from typing import Any

from glance_runtime.errors import GlanceError

from .targets import DeviceProfile


def scheme_of(manifest: dict[str, Any]) -> str:
    return (manifest.get("quantization") or {}).get("scheme", "none")


def engine_manifest(profile: DeviceProfile, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest the engines are built from: refused when the target cannot run its scheme; for quantized
    artifacts, each quantized graph pointed at its TensorRT form and the opset raised to that form's."""
    scheme = scheme_of(manifest)
    if scheme not in profile.quant_schemes:
        raise GlanceError(f"{profile.name} does not run {scheme} weights ({profile.raw['quantization']['note']}); "
                          f"it runs {', '.join(profile.quant_schemes)}: re-export without --quantize or build for rtx")
    quantization = manifest.get("quantization")
    if not quantization:
        return manifest
    graphs = {name: dict(entry) for name, entry in manifest["graphs"].items()}
    for name, entry in quantization["graphs"].items():
        graphs[name].update(file=entry["tensorrt_file"], data_file=entry["tensorrt_data_file"])
    return {**manifest, "graphs": graphs, "opset": max(manifest["opset"], quantization["tensorrt_opset"])}
