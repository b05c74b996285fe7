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
    Worked in place on one int16 copy (a weight's integers are a quarter to half of its fp32 bytes)."""
    half = 1 << (bits - 1)
    signed = unpack(packed, bits).astype(np.int16)
    signed -= half
    np.negative(signed, out=signed, where=(scales < 0)[:, :, None])
    np.minimum(signed, half - 1, out=signed)
    return signed.astype(np.int8).reshape(signed.shape[0], -1)[:, :k], np.abs(scales)


def int_payload(values: np.ndarray, bits: int) -> bytes:
    """Signed values as ONNX stores int8, or int4 two per byte with the first in the low nibble."""
    if bits == 8:
        return np.ascontiguousarray(values, np.int8).tobytes()
    flat = (np.ascontiguousarray(values).ravel() & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()
