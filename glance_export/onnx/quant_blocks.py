"""The numbers of one quantized weight (or a chunk of its rows), from ONNX Runtime's own per-tensor routine.

`DefaultWeightOnlyQuantizer.qbits_block_quant` is what `MatMulNBitsQuantizer` runs on each MatMul weight:
symmetric round-to-nearest, one fp32 scale per `group_size` weights along K, unsigned stored values with
zero point 2^(bits-1). Each column of its [K, N] input is blocked on its own, so the N rows of its output
can be made in chunks.
"""
from __future__ import annotations

import numpy as np

from .quant_scheme import Scheme


def block_quant(b: np.ndarray, scheme: Scheme) -> tuple[np.ndarray, np.ndarray]:
    """B [K, N] fp32 -> packed [N, blocks, blob] uint8 and scales [N, blocks] (MatMulNBits' inputs)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=scheme.group_size, is_symmetric=True, bits=scheme.bits)
    packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(b))
    return packed, scales


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """[N, blocks, blob] uint8 (low bits first) -> [N, blocks, group] unsigned values."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:2], -1)


def positive(packed: np.ndarray, scales: np.ndarray, bits: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed int8 values [N, K] and scales [N, blocks] with every scale >= 0, as TensorRT requires.

    ONNX Runtime's symmetric quantizer gives a block the sign of its largest-magnitude weight, mapped to
    -2^(bits-1); such blocks are negated, and that one value, now 2^(bits-1), is clipped to 2^(bits-1) - 1.
    Worked in int8 on one copy of the integers, the negated blocks apart (int16 passes took four times as long)."""
    half = 1 << (bits - 1)
    if bits == 4:
        signed = unpack(packed, bits).view(np.int8)
        signed -= half
    else:
        signed = (packed ^ np.uint8(half)).view(np.int8)
    flipped = scales < 0
    blocks = signed.reshape(*scales.shape, -1)
    negated = np.negative(blocks[flipped])
    negated[negated == -half] = half - 1  # int8's -(-128) wraps to itself
    np.minimum(negated, half - 1, out=negated)  # int4's -(-8) is 8
    blocks[flipped] = negated
    signed = signed.reshape(scales.shape[0], -1)
    return (signed if signed.shape[1] == k else signed[:, :k]), np.abs(scales)


def int_payload(values: np.ndarray, bits: int) -> bytes:
    """Signed values as ONNX stores int8, or int4 two per byte with the first in the low nibble."""
    if bits == 8:
        return np.ascontiguousarray(values, np.int8).tobytes()
    flat = np.ascontiguousarray(values, np.int8).view(np.uint8).ravel()
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] & 0x0F | flat[1::2] << 4).tobytes()
