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
GROUP_SIZE = 128  # the default: the usual int4 group (AWQ, GPTQ), and ONNX Runtime repacks it with little overhead
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


def check_scheme(name: str, group_size: int, hidden: int, dtype: str, accuracy: str = ACCURACY) -> Scheme:
    """One-line refusals for a scheme these graphs cannot take."""
    if name not in SCHEMES:
        raise GlanceError(f"unknown --quantize {name!r}; use one of {', '.join(SCHEMES)}")
    if accuracy not in ACCURACY_LEVELS:
        raise GlanceError(f"unknown --accuracy {accuracy!r}; use one of {', '.join(ACCURACY_LEVELS)}")
    if group_size not in GROUP_SIZES:
        raise GlanceError(f"--group-size {group_size} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
    if hidden % group_size:
        raise GlanceError(f"--group-size {group_size} does not divide the hidden size {hidden}; pick a smaller one")
    if dtype != "fp32":
        raise GlanceError("--quantize keeps fp32 activations and scales; export with --dtype fp32")
    return Scheme(name, group_size, accuracy)
