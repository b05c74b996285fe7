"""A weight-only quantization scheme (bits and group size) and the refusals for one these graphs cannot take."""
from __future__ import annotations

from dataclasses import dataclass

from glance_runtime.errors import GlanceError

SCHEMES = {"int8": 8, "int4": 4}
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Scheme:
    name: str
    group_size: int

    @property
    def bits(self) -> int:
        return SCHEMES[self.name]


def check_scheme(name: str, group_size: int, hidden: int, dtype: str) -> Scheme:
    """One-line refusals for a scheme these graphs cannot take."""
    if name not in SCHEMES:
        raise GlanceError(f"unknown --quantize {name!r}; use one of {', '.join(SCHEMES)}")
    if group_size not in GROUP_SIZES:
        raise GlanceError(f"--group-size {group_size} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
    if hidden % group_size:
        raise GlanceError(f"--group-size {group_size} does not divide the hidden size {hidden}; pick a smaller one")
    if dtype != "fp32":
        raise GlanceError("--quantize keeps fp32 activations and scales; export with --dtype fp32")
    return Scheme(name, group_size)
