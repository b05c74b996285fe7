"""Sampling where the logits are: `sampling.sample` and `sampling.logprobs` for rows of a logits matrix in CUDA memory,
so a sampled row costs a few dozen bytes across the bus instead of its whole vocabulary (600 KB at 152k tokens).

The kernel (`device_sampling_kernel.SOURCE`, whose docstring gives the algorithm and its one rounding caveat) is
compiled at first use with NVRTC for this GPU's compute capability and loaded through the CUDA driver API
(cuModuleLoadData / cuLaunchKernel, in the primary context the CUDA runtime already made current), then launched on
the device's stream, one block per row. Per call: one small upload (row indices and positions), one launch, one
download of the tokens, log-probs and top_n. Nothing here imports CUDA until a sampler is first used.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from typing import NamedTuple

import numpy as np

from ..decode.sampling import MAX_TOP_N, SamplingParams
from ..errors import GlanceError, InputError
from .device_buffers import Buffer, CudaDevice, Tensor
from .device_sampling_kernel import BLOCK, KERNEL, MAX_TOP, SOURCE

_NVRTC_FIX = ("install the CUDA NVRTC library (JetPack ships it; on x86: pip install nvidia-cuda-nvrtc-cu12, or "
              "nvidia-cuda-nvrtc for CUDA 13), or sample on the host")
_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")  # the host build's IEEE arithmetic
_CUBINS: dict[str, bytes] = {}  # compute capability -> the compiled kernel, shared by every sampler in the process


class Chosen(NamedTuple):
    """What a device sampler brings back per row: the token, its untempered log-prob and the row's top_n best."""
    tokens: np.ndarray  # [n] int64
    logprob: np.ndarray  # [n] float64
    top_ids: np.ndarray  # [n, min(top_n, V)] int64, best first, ties by id
    top: np.ndarray  # [n, min(top_n, V)] float32


def out_bytes(n: int, top_n: int) -> int:
    """The kernel's output for n rows: tokens, log-probs and status (8 bytes each), top ids (8), top log-probs (4)."""
    return n * (24 + 12 * top_n)


def kernel_scalars(params: SamplingParams) -> tuple[float, int, float, float, int]:
    """(temperature, top_k, top_p, min_p, seed) as the kernel takes them: temperature and min_p rounded to float32
    as the numpy sampler rounds them, 0 temperature for greedy."""
    if params.greedy:
        return 0.0, 0, 1.0, 0.0, 0
    return (float(np.float32(params.temperature)), min(int(params.top_k), 2**31 - 1), float(params.top_p),
            float(np.float32(params.min_p)), int(params.seed))


def kernel_args(logits: int, vocab: int, inputs: int, n: int, params: SamplingParams, top_n: int,
                out: int) -> list[ctypes._SimpleCData]:
    """The kernel's arguments in its signature's order and C types, from the addresses of the [R, vocab] logits,
    the int64 inputs (n rows, then their n positions) and the output bytes: the device launch and the host build
    take the very same list."""
    temperature, top_k, top_p, min_p, seed = kernel_scalars(params)
    return [ctypes.c_void_p(logits), ctypes.c_longlong(vocab), ctypes.c_int(vocab), ctypes.c_void_p(inputs),
            ctypes.c_int(n), ctypes.c_float(temperature), ctypes.c_int(top_k), ctypes.c_double(top_p),
            ctypes.c_float(min_p), ctypes.c_ulonglong(seed), ctypes.c_int(top_n), ctypes.c_void_p(out)]


def unpack(raw: np.ndarray, rows: np.ndarray, top_n: int, vocab: int) -> Chosen:
    """The kernel's output bytes as a Chosen (top_n columns, or vocab where fewer, as `sampling.logprobs` gives);
    a row the kernel marked bad (NaN or infinite logits) is refused as the numpy sampler refuses it."""
    n = len(rows)
    raw = np.ascontiguousarray(raw, np.uint8)
    head = raw[:24 * n].view(np.int64).reshape(3, n)
    bad = np.flatnonzero(head[2])
    if bad.size:
        raise GlanceError(f"the target's logits at row {int(rows[bad[0]])} are NaN or infinite, so there is no "
                          "distribution to sample; check the backend's precision (an fp16 overflow)")
    ids = raw[24 * n:(24 + 8 * top_n) * n].view(np.int64).reshape(n, top_n)
    top = raw[(24 + 8 * top_n) * n:out_bytes(n, top_n)].view(np.float32).reshape(n, top_n)
    width = min(top_n, vocab)
    return Chosen(head[0].copy(), head[1].view(np.float64).copy(), ids[:, :width].copy(), top[:, :width].copy())


def check_call(shape: tuple[int, ...], rows: np.ndarray, positions: np.ndarray, params: SamplingParams,
               top_n: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy sampler's refusals for a device call (one line each); returns rows and positions as int64."""
    params.check()
    if type(top_n) is not int or not 0 <= top_n <= MAX_TOP_N:
        raise InputError(f"top_n {top_n!r:.40} is outside 0..{MAX_TOP_N}; pass top_n in 0..{MAX_TOP_N} "
                         "(the OpenAI API's top_logprobs)")
    if len(shape) != 2 or shape[1] == 0:
        raise InputError(f"logits of shape {shape} are not [rows, vocabulary]; pass one row per token")
    rows, positions = np.asarray(rows, np.int64).reshape(-1), np.asarray(positions, np.int64).reshape(-1)
    if rows.shape != positions.shape:
        raise InputError(f"{len(positions)} positions for {len(rows)} rows; pass one position per sampled row")
    if rows.size and (rows.min() < 0 or rows.max() >= shape[0] or positions.min() < 0):
        raise InputError(f"rows {rows.min()}..{rows.max()} or positions from {positions.min()} are outside the "
                         f"{shape[0]} logits rows or below 0; pass rows in 0..{shape[0] - 1} and positions >= 0")
    if not params.greedy and params.seed is None:
        raise InputError("sampling with temperature > 0 needs a seed; pass SamplingParams.seeded() once per "
                         "request so every pass of one answer shares it")
    return rows, positions


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc from the system, else from the NVRTC pip wheel; a one-line refusal naming the fix where neither is.
    A wheel's libnvrtc opens its builtins library by name at compile time, which the loader finds only once it is
    loaded, so that is loaded first."""
    candidates = [("libnvrtc.so", ""), ("libnvrtc.so.13", ""), ("libnvrtc.so.12", "")]
    for package in ("nvidia.cuda_nvrtc", "nvidia.cu13"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            lib = os.path.join(folder, "lib")
            candidates += [(path, lib) for path in sorted(glob.glob(os.path.join(lib, "libnvrtc.so*")), reverse=True)]
    for name, folder in candidates:
        try:
            for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*")) if folder else []):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise GlanceError(f"sampling on the GPU needs NVRTC to build its kernel and none was found; {_NVRTC_FIX}")


def compile_kernel(arch: str) -> bytes:
    """The kernel as a CUBIN for compute capability `arch` ("8.7"), compiled once per process."""
    if arch in _CUBINS:
        return _CUBINS[arch]
    nvrtc = _nvrtc()
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    program = ctypes.c_void_p()

    def check(status: int, what: str) -> None:
        if status != 0:
            log = ""
            size = ctypes.c_size_t()
            if program.value and nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size)) == 0 and size.value > 1:
                text = ctypes.create_string_buffer(size.value)
                nvrtc.nvrtcGetProgramLog(program, text)
                log = " ".join(text.value.decode(errors="replace").split())[:300]
            raise GlanceError(f"NVRTC could not build the sampling kernel for sm_{arch.replace('.', '')} ({what}: "
                              f"{nvrtc.nvrtcGetErrorString(status).decode()}{'; ' + log if log else ''}); use an NVRTC "
                              f"as new as the GPU, or {_NVRTC_FIX}")

    check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), SOURCE.encode(), b"glance_sampling.cu", 0, None, None),
          "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture=sm_{arch.replace('.', '')}".encode(), *(o.encode() for o in _OPTIONS)]
        check(nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options)),
              "nvrtcCompileProgram")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    _CUBINS[arch] = cubin.raw
    return cubin.raw


class DeviceSampler:
    """Samples rows of a device logits matrix on the device; small input and output buffers are kept and reused."""

    def __init__(self, device: CudaDevice) -> None:
        self.device = device
        self._driver: ctypes.CDLL | None = None
        self._context = ctypes.c_void_p()
        self._module = ctypes.c_void_p()
        self._function = ctypes.c_void_p()
        self._inputs: Buffer | None = None
        self._outputs: Buffer | None = None
        self._capacity = 0

    def load(self) -> None:
        """Compile (once per process) and load the kernel into the context the CUDA runtime made current, now rather
        than at the first draw (a caller may sample on the host where this refuses); idempotent."""
        if self._driver is not None:
            return
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            raise GlanceError("sampling on the GPU needs the CUDA driver (libcuda.so.1), which was not found; "
                              "check nvidia-smi, or sample on the host") from None
        cubin = compile_kernel(self.device.compute_capability())
        runtime = self.device._runtime.handle
        self.device._check(runtime.cudaSetDevice(ctypes.c_int(self.device.device_id)), "cudaSetDevice")
        self.device._check(runtime.cudaFree(ctypes.c_void_p(0)), "cudaFree")  # the primary context, made current
        self._check(driver, driver.cuCtxGetCurrent(ctypes.byref(self._context)), "cuCtxGetCurrent")
        self._check(driver, driver.cuModuleLoadData(ctypes.byref(self._module), ctypes.c_char_p(cubin)),
                    "cuModuleLoadData")
        self._check(driver, driver.cuModuleGetFunction(ctypes.byref(self._function), self._module, KERNEL.encode()),
                    "cuModuleGetFunction")
        self._driver = driver

    @staticmethod
    def _check(driver: ctypes.CDLL, status: int, what: str) -> None:
        if status != 0:
            name = ctypes.c_char_p()
            driver.cuGetErrorString(ctypes.c_int(status), ctypes.byref(name))
            raise GlanceError(f"the GPU sampling kernel failed in {what} (CUDA error {status}: "
                              f"{(name.value or b'unknown').decode()}); check the driver (nvidia-smi), or sample "
                              "on the host")

    def _reserve(self, n: int) -> None:
        """Room for n rows, grown (never shrunk) so a steady decode allocates nothing."""
        if n <= self._capacity:
            return
        self._free_buffers()
        self._capacity = max(n, 2 * self._capacity, 16)
        self._inputs = self.device.empty((2 * self._capacity,), np.int64)
        self._outputs = self.device.empty((out_bytes(self._capacity, MAX_TOP),), np.uint8)

    def choose(self, logits: Tensor, rows: np.ndarray, positions: np.ndarray, params: SamplingParams,
               top_n: int = 0) -> Chosen:
        """The token `sampling.sample` draws at each selected row of logits [R, V] (float32, on this device), its
        untempered log-prob, and the row's top_n best as `sampling.logprobs` gives them."""
        if np.dtype(logits.dtype) != np.float32:
            raise InputError(f"device logits are {np.dtype(logits.dtype)}; the device sampler reads float32 rows")
        rows, positions = check_call(tuple(logits.shape), rows, positions, params, top_n)
        n = len(rows)
        if n == 0:
            width = min(top_n, int(logits.shape[1]))
            return Chosen(np.zeros(0, np.int64), np.zeros(0), np.zeros((0, width), np.int64),
                          np.zeros((0, width), np.float32))
        self.load()
        self._reserve(n)
        self.device.upload(self._inputs.tensor((2 * n,)), np.concatenate([rows, positions]))
        vocab = int(logits.shape[1])
        args = kernel_args(logits.ptr, vocab, self._inputs.ptr, n, params, top_n, self._outputs.ptr)
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        driver = self._driver
        self._check(driver, driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        self._check(driver, driver.cuLaunchKernel(self._function, ctypes.c_uint(n), ctypes.c_uint(1), ctypes.c_uint(1),
                                                  ctypes.c_uint(BLOCK), ctypes.c_uint(1), ctypes.c_uint(1),
                                                  ctypes.c_uint(0), ctypes.c_void_p(self.device.stream.ptr),
                                                  pointers, None), "cuLaunchKernel")
        raw = self.device.download(self._outputs.tensor((out_bytes(n, top_n),)))
        return unpack(raw, rows, top_n, vocab)

    def _free_buffers(self) -> None:
        for buffer in (self._inputs, self._outputs):
            if buffer is not None:
                self.device.free(buffer)
        self._inputs = self._outputs = None
        self._capacity = 0

    def close(self) -> None:
        """Free the buffers and unload the kernel (the sampler loads it again if used after)."""
        self._free_buffers()
        if self._driver is not None and self._module.value:
            self._driver.cuModuleUnload(self._module)
        self._driver = None
        self._module, self._function = ctypes.c_void_p(), ctypes.c_void_p()
