"""Device target profiles: what each deployment target's GPU and TensorRT accept, read from JSON data.

The files live in `engines/profiles/` (shipped inside this package as `glance_export/build/profiles`, a link
to that folder), so adding or tuning a target is a data change, not a code change.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from glance_runtime.errors import GlanceError

PROFILE_NAMES = ("jetson-orin", "jetson-thor", "datacenter", "rtx")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    compute_capabilities: tuple[str, ...]  # "8.7", ...
    jetson: str | None  # "orin" / "thor": the Jetson module family this target is
    module: str  # the TensorRT Python module: "tensorrt" or "tensorrt_rtx"
    min_version: str  # accepted TensorRT versions: min_version <= v < below_version
    below_version: str
    install: str  # how to get `module` on the device
    strongly_typed: bool  # the builder takes precision from the ONNX dtypes only (no FP16/BF16 builder flags)
    ahead_of_time: bool  # builds without a GPU on the machine
    timing_cache: bool  # the builder reads and writes timing caches
    precisions: tuple[str, ...]
    default_precision: str
    precision_min_cc: dict[str, str]  # precision -> lowest compute capability that runs it
    precision_note: str
    workspace_gib: float
    max_workspace_gib: float
    workspace_note: str  # why the workspace is bounded where it is (shared memory, the desktop's)
    max_opset: int  # highest opset the oldest accepted parser takes
    attention: str
    attention_op_from: str | None  # TensorRT version from which opset-23 Attention parses
    memory_gib: float
    reserve_gib: float
    memory_note: str
    max_tree: int
    max_batch: int  # sequences a batched round runs by default (never above the export's)
    quant_schemes: tuple[str, ...]  # weight-only schemes its TensorRT builds: "none", "int8", "int4"
    quant_note: str  # why those schemes and no others (the parser's opset)

    def as_shipped(self) -> dict[str, Any]:
        """The profile's file as shipped, which engine manifests record whole."""
        return json.loads(profile_text(self.name))


def profile_text(name: str) -> str:
    if name not in PROFILE_NAMES:
        raise GlanceError(f"unknown target {name!r}; choose one of: jetson, {', '.join(PROFILE_NAMES)}")
    return resources.files("glance_export.build").joinpath("profiles", f"{name}.json").read_text()


def load_profile(name: str) -> DeviceProfile:
    raw = json.loads(profile_text(name))
    trt, prec, parser, memory = raw["tensorrt"], raw["precisions"], raw["parser"], raw["memory"]
    return DeviceProfile(
        name=raw["name"], description=raw["description"], compute_capabilities=tuple(raw["compute_capabilities"]),
        jetson=raw["jetson"], module=trt["module"], min_version=trt["min_version"],
        below_version=trt["below_version"], install=trt["install"], strongly_typed=trt["strongly_typed"],
        ahead_of_time=trt["ahead_of_time"], timing_cache=trt["timing_cache"], precisions=tuple(prec["allowed"]),
        default_precision=prec["default"], precision_min_cc=dict(prec["min_compute_capability"]),
        precision_note=prec["note"], workspace_gib=float(raw["workspace_gib"]["default"]),
        max_workspace_gib=float(raw["workspace_gib"]["max"]), workspace_note=raw["workspace_gib"]["note"],
        max_opset=int(parser["max_opset"]),
        attention=parser["attention"], attention_op_from=parser["attention_op_from"],
        memory_gib=float(memory["memory_gib"]), reserve_gib=float(memory["reserve_gib"]), memory_note=memory["note"],
        max_tree=int(raw["max_tree"]), max_batch=int(raw["max_batch"]),
        quant_schemes=tuple(raw["quantization"]["schemes"]),
        quant_note=raw["quantization"]["note"])


def version_tuple(text: str) -> tuple[int, ...]:
    """Numeric prefix of a version string: "10.3.0.30" -> (10, 3, 0, 30), "1.7.1.116" -> (1, 7, 1, 116)."""
    parts = []
    for piece in str(text).split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)
