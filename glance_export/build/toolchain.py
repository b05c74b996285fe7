"""The local TensorRT module a target profile names (`tensorrt` or `tensorrt_rtx`), and its version checks.

Both modules share the builder API, so the build has one code path; what differs (strong typing, timing
caches, building without a GPU) is stated in the profile. The version is a field of `Toolchain` so that
tests can check a version they do not have installed.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from glance_runtime.errors import GlanceError

from .targets import DeviceProfile, version_tuple


@dataclass(frozen=True)
class Toolchain:
    module: ModuleType
    version: str

    @property
    def name(self) -> str:
        return self.module.__name__


def load_toolchain(profile: DeviceProfile) -> Toolchain:
    try:
        module = importlib.import_module(profile.module)
    except ImportError:
        raise GlanceError(f"{profile.name} engines are built with {profile.module}, which is not installed here "
                          f"({profile.install}); or write a bundle to build on the device with --plan-only") from None
    return Toolchain(module, module.__version__)


def check_version(profile: DeviceProfile, toolchain: Toolchain) -> None:
    version = version_tuple(toolchain.version)
    if not version_tuple(profile.min_version) <= version < version_tuple(profile.below_version):
        raise GlanceError(f"{toolchain.name} {toolchain.version} is outside the {profile.name} range "
                          f"(>= {profile.min_version}, < {profile.below_version}); install a version in range: "
                          f"{profile.install}")


def check_opset(profile: DeviceProfile, opset: int, version: str | None) -> None:
    """Opset 23 (the ONNX Attention op) parses from `attention_op_from` on; older parsers need opset <= max_opset.

    `version` None (a plan for another machine) accepts what any version in the profile's range parses."""
    newest = profile.below_version if version is None else version
    since = profile.attention_op_from
    attention_ok = since is not None and version_tuple(newest) >= version_tuple(since)
    limit = 23 if attention_ok else profile.max_opset
    if opset > limit:
        where = f"{profile.module} {version}" if version else f"the {profile.name} target"
        raise GlanceError(f"these artifacts are opset {opset}, and {where} parses opset <= {limit}; re-export with "
                          f"`glance-export onnx --opset 17` (plain MatMul/Softmax attention)")
