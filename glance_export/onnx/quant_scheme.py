"""A weight-only quantization scheme (bits, group size, and how the ONNX Runtime form computes with its weights)
and the refusals for one these graphs cannot take.

`accuracy` is MatMulNBits' compute mode on ONNX Runtime's CPU provider: "int8" (accuracy_level 4) quantizes
each row's activations to int8 per block and multiplies in integers, the fast path for several rows at once
(and what ONNX Runtime GenAI's CPU int4 builds use); "exact" (accuracy_level 0) dequantizes the weights and
multiplies in fp32, so an n-row pass gives every row exactly what a 1-row pass gives it. The TensorRT form
is unaffected (its DequantizeLinear is exact)."""
from __future__ import annotations

from dataclasses import dataclass

from glance_runtime.errors import GlanceError

SCHEMES = {"int8": 8, "int4": 4}
GROUP_SIZES = (32, 64, 128)
GROUP_SIZE = max(GROUP_SIZES)  # the default wherever it divides the hidden size: the usual int4 group (AWQ, GPTQ)
ACCURACY_LEVELS = {"int8": 4, "exact": 0}  # --accuracy -> MatMulNBits accuracy_level
ACCURACY = "int8"


@dataclass(frozen=True)
class Scheme:
    name: str
    group_size: int
    accuracy: str = ACCURACY

    @property
    def bits(self) -> int:
        return SCHEMES[self.name]

    @property
    def accuracy_level(self) -> int:
        return ACCURACY_LEVELS[self.accuracy]


def _sizes(sizes) -> str:
    return ", ".join(map(str, sizes))


def pick_group_size(group_size: int | None, hidden: int) -> int:
    """The group size asked for, or (None) the largest supported one that divides the hidden size, so the
    default fits every model (the embedded one is 192 wide, which 128 does not divide)."""
    fits = [g for g in GROUP_SIZES if hidden % g == 0]
    if group_size is not None and group_size not in GROUP_SIZES:
        raise GlanceError(f"--group-size {group_size} is not supported; use one of {_sizes(GROUP_SIZES)}")
    if group_size is not None and hidden % group_size == 0:
        return group_size
    if not fits:
        raise GlanceError(f"none of the supported group sizes {_sizes(GROUP_SIZES)} divides the hidden size {hidden}; "
                          "export this model without --quantize")
    if group_size is not None:
        raise GlanceError(f"--group-size {group_size} does not divide the hidden size {hidden}; pass --group-size "
                          f"{' or '.join(map(str, fits))} (or leave it out: {max(fits)})")
    return max(fits)


def group_size_line(group_size: int, hidden: int) -> str:
    """The log line for a group size picked by default."""
    return (f"quantizing with group size {group_size}: the largest of {_sizes(GROUP_SIZES)} that divides the hidden "
            f"size {hidden} (--group-size picks another)")


def check_scheme(name: str, group_size: int | None, hidden: int, dtype: str, accuracy: str = ACCURACY) -> Scheme:
    """One-line refusals for a scheme these graphs cannot take; `group_size` None picks one (`pick_group_size`)."""
    if name not in SCHEMES:
        raise GlanceError(f"unknown --quantize {name!r}; use one of {', '.join(SCHEMES)}")
    if accuracy not in ACCURACY_LEVELS:
        raise GlanceError(f"unknown --accuracy {accuracy!r}; use one of {', '.join(ACCURACY_LEVELS)}")
    size = pick_group_size(group_size, hidden)
    if dtype != "fp32":
        raise GlanceError("--quantize keeps fp32 activations and scales; export with --dtype fp32")
    return Scheme(name, size, accuracy)
