"""Which precision an engine is built at, and how: by the ONNX dtypes or by a builder flag.

TensorRT-RTX networks are strongly typed (it has no FP16/BF16 builder flags): the engine computes in the
graph's dtypes, so a precision other than the export's needs another export. Full TensorRT 10 can build
an fp32 graph at fp16 or bf16 with `BuilderFlag.FP16` / `BF16`. FP8 needs quantize/dequantize nodes that
`glance-export onnx` does not write, so it is refused on every target rather than silently built wider.
"""
from __future__ import annotations

from dataclasses import dataclass

from glance_runtime.errors import GlanceError

from .targets import DeviceProfile
from .local_gpu import BuildGpu, meets

EXPORT_DTYPES = ("fp32", "fp16")  # what `glance-export onnx --dtype` writes
PRECISIONS = ("fp32", "fp16", "bf16", "fp8")


@dataclass(frozen=True)
class Precision:
    name: str
    builder_flag: str | None  # BuilderFlag member to set; None: the graph's own dtypes
    how: str  # recorded in engines.json


def default_precision(profile: DeviceProfile, artifacts_dtype: str) -> str:
    """The profile's default, except that a strongly typed builder follows the export's dtype."""
    if profile.strongly_typed and artifacts_dtype in profile.precisions:
        return artifacts_dtype
    return profile.default_precision


def choose_precision(profile: DeviceProfile, requested: str | None, artifacts_dtype: str, device: BuildGpu) -> Precision:
    name = requested or default_precision(profile, artifacts_dtype)
    if name not in profile.precisions:
        raise GlanceError(f"{profile.name} cannot run {name} engines ({profile.precision_note}); "
                          f"use --precision {' or '.join(profile.precisions)}")
    minimum = profile.precision_min_cc.get(name)
    if minimum and device.compute_capability and not meets(device.compute_capability, minimum):
        raise GlanceError(f"{name} needs compute capability >= {minimum} and {device.describe()} is below it; "
                          f"use --precision {profile.default_precision}")
    if name == "fp8":
        raise GlanceError("fp8 engines need an FP8-quantized export (quantize/dequantize nodes), and `glance-export "
                          "onnx` writes fp32 or fp16 graphs; use --precision fp16 or bf16")
    if name == artifacts_dtype:
        return Precision(name, None, f"the graphs' own {name} dtypes")
    if profile.strongly_typed:
        exportable = " or ".join(EXPORT_DTYPES)
        fix = (f"re-export with `glance-export onnx --dtype {name}`" if name in EXPORT_DTYPES
               else f"`glance-export onnx` exports {exportable} only; use --precision {artifacts_dtype}")
        raise GlanceError(f"{profile.module} builds strongly typed networks (precision comes from the ONNX dtypes) "
                          f"and these artifacts are {artifacts_dtype}, not {name}; {fix}")
    if artifacts_dtype != "fp32":
        raise GlanceError(f"these artifacts are {artifacts_dtype}; a {name} engine is built from an fp32 export: "
                          f"re-export with `glance-export onnx --dtype fp32`")
    return Precision(name, name.upper(), f"BuilderFlag.{name.upper()} on the fp32 graphs (weakly typed network)")
