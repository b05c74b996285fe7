"""Whether this machine's memory holds what ONNX Runtime's CPU provider is about to open.

A CPU session keeps every weight in host memory, and an fp16 or bf16 weight as an fp32 copy made when the
session is created: x86 has no half-precision MatMul kernel, so the provider casts each such weight once
(measured with onnxruntime 1.32: 581 MB resident for 268 MB of fp16 MatMul weights, the fp16 bytes
released). Graphs that do not fit end with the kernel killing the process minutes into the load; the
refusal here comes first, in one line, from sizes the manifest records.
"""
from __future__ import annotations

from ..errors import GlanceError
from ..formats.artifacts import Manifest
from .hardware import available_host_bytes

GIB = float(1 << 30)
# The interpreter, onnxruntime, the tokenizer and the sessions' activation arenas for a prompt with an image:
# a full-depth Qwen2-VL-2B fp16 export (4.21 GiB of graphs) decoded at 9.48 GiB, 1.06 GiB over twice its graphs.
PROCESS_BYTES = 5 << 28
HALF_PRECISION = ("fp16", "bf16")


def weight_bytes(manifest: Manifest) -> int:
    """Bytes of every graph file and data file the backend opens (not the TensorRT forms beside them): one
    session a graph, however many sequences it batches."""
    return sum(manifest.file_hashes[name].size for entry in manifest.graphs.values()
               for name in (entry.file, entry.data_file) if name)


def buffer_bytes(manifest: Manifest, max_context: int, max_batch: int = 1) -> int:
    """The backend's context-sized host buffers: both KV caches (a pool of `max_batch` of each) and the tree
    mask dominate."""
    itemsize = 2 if manifest.float_dtype == "float16" else 4
    kv = sum(2 * s.num_layers * s.kv_heads * s.head_dim for s in (manifest.target, manifest.head))
    return max_context * (max_batch * kv * itemsize + 2 * manifest.hidden_size * itemsize) + max_context * max_context


def cpu_load_bytes(manifest: Manifest, max_context: int, max_batch: int = 1) -> int:
    """Host bytes a CPU-provider backend needs at load: the weights (as fp32 when exported in half
    precision), its buffers and the process."""
    scale = 2 if manifest.dtype in HALF_PRECISION else 1
    return (scale * weight_bytes(manifest) + buffer_bytes(manifest, max_context, max_batch)
            + PROCESS_BYTES)


def check_cpu_room(manifest: Manifest, max_context: int, available: int | None, max_batch: int = 1) -> None:
    """Refuse, before any session opens, a CPU load this machine's available memory cannot hold."""
    need = cpu_load_bytes(manifest, max_context, max_batch)
    if available is None or need <= available:
        return
    half = (f" (ONNX Runtime's CPU provider holds {manifest.dtype} weights as fp32 copies)"
            if manifest.dtype in HALF_PRECISION else "")
    raise GlanceError(f"loading {manifest.path} on the CPU needs about {need / GIB:.1f} GiB{half} and this machine "
                      f"has {available / GIB:.1f} GiB available ({(need - available) / GIB:.1f} GiB short); close "
                      "other programs, lower --max-batch or --max-context, run it on a GPU provider, or export it "
                      "with --dtype fp32 --quantize int4")


def check_this_machine(manifest: Manifest, max_context: int, max_batch: int = 1) -> None:
    check_cpu_room(manifest, max_context, available_host_bytes(), max_batch)
