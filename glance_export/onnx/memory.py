"""The export's peak memory, estimated from the snapshot's tensor index before any work, and the refusal
when this machine cannot hold it.

Nothing scales with the depth of the model: tracing runs on meta tensors, weights stream to disk one
tensor at a time (read as stored, cast and transposed slice by slice), and the full-depth smoke run
loads one segment of the target at a time. What is resident at once is the process itself (torch,
transformers, onnx and ONNX Runtime), the one tensor being written, and the one graph being
validated: its torch module (the vocabulary matrices, the vision tower, the head, or a target small
enough to validate whole; a larger target as its depth cut), then, once torch's outputs are taken and
its weights dropped, ONNX Runtime running the graph one segment of weights at a time. On a CPU without
fp16 kernels a segment's session also holds an fp32 copy of each fp16 weight. What a closed session
freed goes back to the system before the next opens (`allocator.py`).

Quantization (`--quantize`) reads, quantizes and writes one weight at a time in place of the fp32 writer: a
layer's fp32 MatMul weight whole with the integer copies made from it, or a chunk of a vocabulary matrix's
rows plus that matrix's scales. Its validation multiplies each quantized weight back out into the copy read
for torch (a head's weights, which the export holds, into a new tensor).
"""
from __future__ import annotations

from dataclasses import dataclass

from glance_runtime.errors import GlanceError

from .checkpoint import Checkpoint
from .segments import SEGMENT_BYTES
from .stream import SLICE_BYTES

GIB = 1 << 30
PROCESS_BYTES = int(1.25 * GIB)  # interpreter, torch, transformers, onnx and ONNX Runtime, measured at import
QUANT_COPIES = 2  # a MatMul weight's fp32 values, then its stored, signed, negated and clipped integers
SMALLEST_GROUP = 32  # the most scales per weight: one fp32 scale per 32 weights


@dataclass(frozen=True)
class Estimate:
    peak: int
    graphs: int  # bytes of all exported graphs
    largest_tensor: int
    validated: int  # the largest module validated at once (in torch, then in ONNX Runtime)


def _rescaled(checkpoint: Checkpoint, keys: list[str], itemsize: int) -> int:
    entries = [checkpoint.entries[k] for k in keys]
    return sum(e.numel * itemsize if e.dtype.is_floating_point else e.length for e in entries)


def estimate_peak(checkpoint: Checkpoint, itemsize: int, head_bytes: int, layers: int, cut_layers: int,
                  full_validation_bytes: int, quantize: bool = False) -> Estimate:
    """Peak RSS of an export at `itemsize` bytes per weight, from the tensor index alone.

    Quantization holds one weight at a time (see the module's note), after the export's own peak."""
    keys = list(checkpoint.entries)
    vision = [k for k in keys if "visual" in k]
    vocab = [k for k in keys if "embed_tokens" in k or k.endswith("lm_head.weight")]
    stack = [k for k in keys if k not in vision and k not in vocab]
    stack_bytes = _rescaled(checkpoint, stack, itemsize)
    target_validated = stack_bytes if stack_bytes <= full_validation_bytes or layers <= cut_layers \
        else stack_bytes * cut_layers // max(layers, 1)
    validated = max(_rescaled(checkpoint, vocab, itemsize), _rescaled(checkpoint, vision, itemsize), head_bytes,
                    target_validated)
    largest = max((e.length for e in checkpoint.entries.values()), default=0)  # read as stored
    graphs = checkpoint.nbytes(itemsize) + head_bytes
    session = 3 if itemsize == 2 else 1  # the mapped weights, plus their fp32 copy when they are fp16
    largest_cast = max((e.numel * itemsize for e in checkpoint.entries.values() if e.dtype.is_floating_point),
                       default=0)
    segment = max(SEGMENT_BYTES, largest_cast)  # ONNX Runtime's share: one segment, at least one whole weight
    # torch's module fills tensor by tensor, each read as stored and then cast beside what is already in
    working = max(largest + SLICE_BYTES, validated + largest, session * min(segment, validated))
    if quantize:
        matmul = max((checkpoint.entries[k].numel * 4 for k in stack if len(checkpoint.entries[k].shape) == 2),
                     default=0)
        vocab_scales = max((checkpoint.entries[k].numel * 4 // SMALLEST_GROUP for k in vocab), default=0)
        working = max(working, QUANT_COPIES * max(matmul, SLICE_BYTES) + 4 * vocab_scales)
    return Estimate(PROCESS_BYTES + working, graphs, largest, validated)


def check_fits(estimate: Estimate, dtype: str, available: int | None, quantize: bool = False) -> None:
    """One-line refusal, before any work, when the estimated peak exceeds the memory available now."""
    if available is None or estimate.peak <= available:
        return
    short = (estimate.peak - available) / GIB
    change = "export with --dtype fp16 (half the weight bytes), " if dtype == "fp32" and not quantize else ""
    raise GlanceError(f"this export needs about {estimate.peak / GIB:.1f} GiB at its peak and this machine has "
                      f"{available / GIB:.1f} GiB available ({short:.1f} GiB short); {change}close other programs, "
                      f"or run it on a machine with {estimate.peak / GIB:.0f} GiB free")
