"""Which weight-only schemes a device target's TensorRT runs, and the graph files it builds them from.

Quantized artifacts carry two forms of each quantized graph (see `onnx/quantize.py`): ONNX Runtime's
(MatMulNBits) under the usual names and TensorRT's (blocked DequantizeLinear, opset 21) under
`tensorrt/`. This module imports neither torch nor onnx: a Jetson builds from an export made elsewhere.
"""
from __future__ import annotations

from dataclasses import replace

from glance_runtime.errors import GlanceError
from glance_runtime.formats.artifacts import Manifest

from .targets import DeviceProfile


def scheme_of(manifest: Manifest) -> str:
    return manifest.quantization.scheme if manifest.quantization else "none"


def engine_manifest(profile: DeviceProfile, manifest: Manifest) -> Manifest:
    """The manifest the engines are built from: refused when the target cannot run its scheme; for quantized
    artifacts, each quantized graph pointed at its TensorRT form and the opset raised to that form's."""
    scheme = scheme_of(manifest)
    if scheme not in profile.quant_schemes:
        raise GlanceError(f"{profile.name} does not run {scheme} weights ({profile.quant_note}); "
                          f"it runs {', '.join(profile.quant_schemes)}: re-export without --quantize or build for rtx")
    q = manifest.quantization
    if q is None:
        return manifest
    graphs = {name: replace(entry, file=q.tensorrt_graphs[name].file, data_file=q.tensorrt_graphs[name].data_file)
              if name in q.tensorrt_graphs else entry for name, entry in manifest.graphs.items()}
    return replace(manifest, graphs=graphs, opset=max(manifest.opset, q.tensorrt_opset))
