"""The device layer: buffers, copies and a stream, with one interface for host memory and for CUDA.

Graph backends keep every cache and intermediate in `Buffer`s and hand graphs raw addresses, so the
same binding code serves ONNX Runtime on the CPU (host buffers), ONNX Runtime on CUDA and TensorRT
(device buffers). `HostDevice` is not a stand-in: it is the real memory of the CPU path, and it counts
its traffic exactly as `CudaDevice` does, so tests on a CPU prove what crosses the host boundary.

CUDA goes through Polygraphy's wrapper (`polygraphy.cuda`): pure Python over the CUDA runtime that
JetPack and every CUDA install already ship, so it installs the same on Jetson (aarch64) and x86 with
no binary wheel tied to one CUDA major version (unlike cuda-bindings 12/13 or cupy-cuda12x/13x), and
it is what TensorRT's own tools use. The one call it does not wrap, `cudaMemcpy2DAsync` (a run of
rows moved in every layer's cache at once), goes through the same loaded runtime library.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from math import prod
from typing import NamedTuple

import numpy as np

from ..errors import GlanceError


@dataclass
class Traffic:
    """What crossed the host boundary, and how many device calls were made (copies and syncs)."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.h2d_bytes = self.d2h_bytes = self.d2d_bytes = self.calls = 0


@dataclass(eq=False)
class Buffer:
    """A fixed block of device (or host) memory holding an array of `shape` and `dtype`."""

    device: "Device"
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    host: np.ndarray | None = field(default=None, repr=False)  # the backing array on a HostDevice

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the leading axis."""
        return prod(self.shape[1:]) * self.dtype.itemsize

    def tensor(self, shape: tuple[int, ...], offset: int = 0) -> "Tensor":
        """A view of `shape` starting `offset` bytes in, to bind as a graph input or output."""
        shape = tuple(int(s) for s in shape)
        if offset < 0 or offset + prod(shape) * self.dtype.itemsize > self.nbytes:
            raise ValueError(f"view {shape} at byte {offset} exceeds a buffer of {self.nbytes} bytes")
        return Tensor(self, offset, shape)

    def rows(self, count: int, first: int = 0) -> "Tensor":
        """Rows first..first+count of the leading axis."""
        return self.tensor((count, *self.shape[1:]), first * self.row_bytes)

    def after(self, first: int) -> "Buffer":
        """Rows first.. as a buffer of their own (the same memory), for a pass that writes its rows after
        rows already there."""
        if not 0 <= first <= self.shape[0]:
            raise ValueError(f"row {first} is outside a buffer of {self.shape[0]} rows")
        host = self.host[first:] if self.host is not None else None
        return Buffer(self.device, self.ptr + first * self.row_bytes, (self.shape[0] - first, *self.shape[1:]),
                      self.dtype, host)


class Tensor(NamedTuple):
    """A typed, shaped view into a Buffer: what a graph binding needs (address, shape, dtype). A plain
    tuple, because a round makes a few hundred of them."""

    buffer: Buffer
    offset: int
    shape: tuple[int, ...]

    @property
    def ptr(self) -> int:
        return self.buffer.ptr + self.offset

    @property
    def dtype(self) -> np.dtype:
        return self.buffer.dtype

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.buffer.dtype.itemsize


class Device:
    """Allocation, copies and synchronization; subclasses move the bytes."""

    kind = "cpu"
    device_id = 0

    def __init__(self) -> None:
        self.traffic = Traffic()

    def empty(self, shape: tuple[int, ...], dtype) -> Buffer:
        raise NotImplementedError

    def free(self, buffer: Buffer) -> None:
        """Release a buffer (its views must no longer be used)."""
        raise NotImplementedError

    def upload(self, dst: Tensor, array: np.ndarray) -> None:
        """Host array -> device view of the same size (asynchronous on CUDA; the array must stay alive
        until the next synchronize, which the backends guarantee by reusing staging arrays)."""
        array = np.ascontiguousarray(array, dtype=dst.dtype)
        if array.nbytes != dst.nbytes:
            raise ValueError(f"upload of {array.nbytes} bytes into a view of {dst.nbytes}")
        self.traffic.h2d_bytes += array.nbytes
        self.traffic.calls += 1
        self._h2d(dst, array)

    def download(self, src: Tensor) -> np.ndarray:
        """Device view -> a new host array (waits for the stream)."""
        out = np.empty(src.shape, src.dtype)
        self.traffic.d2h_bytes += out.nbytes
        self.traffic.calls += 2
        self._d2h(out, src)
        return out

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """Device-to-device copy of equal-sized views that do not overlap."""
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into a view of {dst.nbytes}")
        self.traffic.d2d_bytes += src.nbytes
        self.traffic.calls += 1
        self._d2d(dst, src)

    def copy_2d(self, buffer: Buffer, dst: int, src: int, width: int, height: int, pitch: int) -> None:
        """Within one buffer: `height` blocks of `width` bytes, `pitch` apart, from byte offset src to dst
        (one call on CUDA)."""
        self.traffic.d2d_bytes += width * height
        self.traffic.calls += 1
        self._d2d_2d(buffer, dst, src, width, height, pitch)

    def copy_strided(self, dst: Buffer, dst_offset: int, dst_pitch: int, src: Buffer, src_offset: int,
                     src_pitch: int, width: int, height: int) -> None:
        """Between buffers: `height` blocks of `width` bytes, each buffer with its own pitch (one call on CUDA): a
        run of rows moved into a KV pool slot in every layer at once, from a pass's output laid out otherwise."""
        if height and (src_offset + (height - 1) * src_pitch + width > src.nbytes
                       or dst_offset + (height - 1) * dst_pitch + width > dst.nbytes):
            raise ValueError(f"a strided copy of {height} x {width} bytes runs past its buffers")
        self.traffic.d2d_bytes += width * height
        self.traffic.calls += 1
        self._d2d_strided(dst, dst_offset, dst_pitch, src, src_offset, src_pitch, width, height)

    def copy_rows(self, dst: Buffer, dst_rows: np.ndarray, src: Buffer, src_rows: np.ndarray, row_bytes: int) -> None:
        """Row dst_rows[i] of dst <- row src_rows[i] of src, both seen as rows of `row_bytes`: a batched round's
        scattered rows (embeddings, kept KV rows) in one gather on the host, a copy a row on a GPU."""
        dst_rows, src_rows = np.asarray(dst_rows, np.int64), np.asarray(src_rows, np.int64)
        if len(dst_rows) != len(src_rows):
            raise ValueError(f"{len(src_rows)} rows copied into {len(dst_rows)}")
        if len(dst_rows) and (dst_rows.min() < 0 or src_rows.min() < 0 or (dst_rows.max() + 1) * row_bytes > dst.nbytes
                              or (src_rows.max() + 1) * row_bytes > src.nbytes):
            raise ValueError("a row copy runs past its buffers")
        self.traffic.d2d_bytes += len(dst_rows) * row_bytes
        self.traffic.calls += len(dst_rows)
        self._d2d_rows(dst, dst_rows, src, src_rows, row_bytes)

    def _d2d_rows(self, dst: Buffer, dst_rows: np.ndarray, src: Buffer, src_rows: np.ndarray, row_bytes: int) -> None:
        for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
            self._d2d(dst.tensor((row_bytes // dst.dtype.itemsize,), d * row_bytes),
                      src.tensor((row_bytes // src.dtype.itemsize,), s * row_bytes))

    def zeros(self, shape: tuple[int, ...], dtype) -> Buffer:
        """A new buffer of zeros (a KV pool: rows a batched pass reads but masks must never hold NaN)."""
        buffer = self.empty(shape, dtype)
        self.traffic.calls += 1
        self._zero(buffer)
        return buffer

    def synchronize(self) -> None:
        self.traffic.calls += 1

    def _d2d_strided(self, dst: Buffer, dst_offset: int, dst_pitch: int, src: Buffer, src_offset: int,
                     src_pitch: int, width: int, height: int) -> None:
        raise NotImplementedError

    def _zero(self, buffer: Buffer) -> None:
        raise NotImplementedError

    def _h2d(self, dst: Tensor, array: np.ndarray) -> None:
        raise NotImplementedError

    def _d2h(self, out: np.ndarray, src: Tensor) -> None:
        raise NotImplementedError

    def _d2d(self, dst: Tensor, src: Tensor) -> None:
        raise NotImplementedError

    def _d2d_2d(self, buffer: Buffer, dst: int, src: int, width: int, height: int, pitch: int) -> None:
        raise NotImplementedError


class HostDevice(Device):
    """Host memory: buffers are numpy arrays, addresses are theirs (ONNX Runtime's CPU provider binds them)."""

    kind = "cpu"

    def empty(self, shape: tuple[int, ...], dtype) -> Buffer:
        dtype = np.dtype(dtype)
        raw = np.zeros(max(prod(shape) * dtype.itemsize, 1), np.uint8)
        view = raw[:prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
        return Buffer(self, raw.ctypes.data, tuple(shape), dtype, view)

    def free(self, buffer: Buffer) -> None:
        buffer.host = None

    @staticmethod
    def _bytes(t: Tensor) -> np.ndarray:
        raw = t.buffer.host.reshape(-1).view(np.uint8)
        return raw[t.offset:t.offset + t.nbytes]

    def _h2d(self, dst: Tensor, array: np.ndarray) -> None:
        self._bytes(dst)[:] = array.reshape(-1).view(np.uint8)

    def _d2h(self, out: np.ndarray, src: Tensor) -> None:
        out.reshape(-1).view(np.uint8)[:] = self._bytes(src)

    def _d2d(self, dst: Tensor, src: Tensor) -> None:
        self._bytes(dst)[:] = self._bytes(src)

    def _d2d_2d(self, buffer: Buffer, dst: int, src: int, width: int, height: int, pitch: int) -> None:
        raw = buffer.host.reshape(-1).view(np.uint8)
        blocks = np.arange(height) * pitch
        cols = np.arange(width)
        raw[(blocks + dst)[:, None] + cols] = raw[(blocks + src)[:, None] + cols]

    def _d2d_strided(self, dst: Buffer, dst_offset: int, dst_pitch: int, src: Buffer, src_offset: int,
                     src_pitch: int, width: int, height: int) -> None:
        def blocks(buffer: Buffer, offset: int, pitch: int) -> np.ndarray:
            raw = buffer.host.reshape(-1).view(np.uint8)[offset:]
            return np.lib.stride_tricks.as_strided(raw, shape=(height, width), strides=(pitch, 1))
        blocks(dst, dst_offset, dst_pitch)[:] = blocks(src, src_offset, src_pitch)

    def zeros(self, shape: tuple[int, ...], dtype) -> Buffer:
        return self.empty(shape, dtype)  # host buffers start zeroed (their pages are touched only when written)

    def _d2d_rows(self, dst: Buffer, dst_rows: np.ndarray, src: Buffer, src_rows: np.ndarray, row_bytes: int) -> None:
        def rows(buffer: Buffer) -> np.ndarray:
            return buffer.host.reshape(-1).view(np.uint8).reshape(-1, row_bytes)
        rows(dst)[dst_rows] = rows(src)[src_rows]


class CudaDevice(Device):
    """CUDA memory on one stream, through Polygraphy's CUDA runtime wrapper (see the module docstring)."""

    kind = "cuda"
    _DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice
    _CC_MAJOR, _CC_MINOR = 75, 76  # cudaDevAttrComputeCapabilityMajor / Minor

    def __init__(self, device_id: int = 0) -> None:
        super().__init__()
        try:
            from polygraphy import cuda
        except ImportError:
            raise GlanceError("CUDA buffers need polygraphy's CUDA wrapper, which is not installed; add the gpu "
                              "extra (pip install -e '.[gpu]' in the clone, or pip install polygraphy)") from None
        self.device_id = device_id
        self._cuda = cuda
        try:
            self._runtime = cuda.wrapper()
            status = self._runtime.handle.cudaSetDevice(ctypes.c_int(device_id))
        except Exception as exc:  # a missing libcudart surfaces as OSError or Polygraphy's own exception
            raise GlanceError(f"no CUDA runtime here ({type(exc).__name__}); the GPU backends need an NVIDIA GPU "
                              "with its driver and CUDA runtime (JetPack on Jetson)") from None
        if status != 0:
            raise GlanceError(f"no usable CUDA GPU {device_id} (CUDA error {status}); check nvidia-smi, or use "
                              "the CPU: --backend onnxruntime --provider cpu")
        self.stream = cuda.Stream()
        self._keep: dict[int, object] = {}  # address -> its DeviceArray, alive until freed
        self._staging: list[np.ndarray] = []  # host sources of uploads in flight, until the next synchronize

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise GlanceError(f"CUDA error {status} in {what}; check the GPU and driver (nvidia-smi)")

    def compute_capability(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        handle = self._runtime.handle
        for attr, out in ((self._CC_MAJOR, major), (self._CC_MINOR, minor)):
            self._check(handle.cudaDeviceGetAttribute(ctypes.byref(out), ctypes.c_int(attr),
                                                      ctypes.c_int(self.device_id)), "cudaDeviceGetAttribute")
        return f"{major.value}.{minor.value}"

    def empty(self, shape: tuple[int, ...], dtype) -> Buffer:
        dtype = np.dtype(dtype)
        array = self._cuda.DeviceArray.raw((max(prod(shape) * dtype.itemsize, 1),))  # never a null address
        self._keep[int(array.ptr)] = array
        return Buffer(self, int(array.ptr), tuple(shape), dtype)

    def free(self, buffer: Buffer) -> None:
        self.synchronize()
        array = self._keep.pop(buffer.ptr, None)
        if array is not None:
            array.free()

    def _h2d(self, dst: Tensor, array: np.ndarray) -> None:
        self._staging.append(array)
        self._runtime.memcpy(dst.ptr, array.ctypes.data, array.nbytes, self._cuda.MemcpyKind.HostToDevice,
                             self.stream.ptr)

    def _d2h(self, out: np.ndarray, src: Tensor) -> None:
        self._runtime.memcpy(out.ctypes.data, src.ptr, out.nbytes, self._cuda.MemcpyKind.DeviceToHost,
                             self.stream.ptr)
        self.synchronize()

    def _d2d(self, dst: Tensor, src: Tensor) -> None:
        self._runtime.memcpy(dst.ptr, src.ptr, src.nbytes, self._cuda.MemcpyKind.DeviceToDevice, self.stream.ptr)

    def _d2d_2d(self, buffer: Buffer, dst: int, src: int, width: int, height: int, pitch: int) -> None:
        size = ctypes.c_size_t
        self._check(self._runtime.handle.cudaMemcpy2DAsync(
            ctypes.c_void_p(buffer.ptr + dst), size(pitch), ctypes.c_void_p(buffer.ptr + src), size(pitch),
            size(width), size(height),
            ctypes.c_int(self._DEVICE_TO_DEVICE), ctypes.c_void_p(self.stream.ptr)), "cudaMemcpy2DAsync")

    def _d2d_strided(self, dst: Buffer, dst_offset: int, dst_pitch: int, src: Buffer, src_offset: int,
                     src_pitch: int, width: int, height: int) -> None:
        size = ctypes.c_size_t
        self._check(self._runtime.handle.cudaMemcpy2DAsync(
            ctypes.c_void_p(dst.ptr + dst_offset), size(dst_pitch), ctypes.c_void_p(src.ptr + src_offset),
            size(src_pitch), size(width), size(height),
            ctypes.c_int(self._DEVICE_TO_DEVICE), ctypes.c_void_p(self.stream.ptr)), "cudaMemcpy2DAsync")

    def _zero(self, buffer: Buffer) -> None:
        self._check(self._runtime.handle.cudaMemsetAsync(ctypes.c_void_p(buffer.ptr), ctypes.c_int(0),
                                                         ctypes.c_size_t(buffer.nbytes),
                                                         ctypes.c_void_p(self.stream.ptr)), "cudaMemsetAsync")

    def synchronize(self) -> None:
        super().synchronize()
        self.stream.synchronize()
        self._staging = []
