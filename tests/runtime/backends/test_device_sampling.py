"""The device sampler's kernel against the numpy sampler it must equal. Its source is built here with the host C++
compiler (every barrier-separated phase a loop over thread ids, the blocks run one after another: the same logic,
not a second implementation) and checked token for token on many fixed random cases; the same source is compiled
for Jetson Orin and Hopper with nvcc where there is one; and on a GPU the sampler itself runs on CUDA memory."""
from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess

import numpy as np
import pytest

from glance_runtime.backends.device_sampling import (Chosen, DeviceSampler, _nvrtc, check_call, compile_kernel,
                                                     kernel_args, out_bytes, unpack)
from glance_runtime.backends.device_sampling_kernel import HOST_ENTRY, SOURCE
from glance_runtime.decode.sampling import SamplingParams, logprobs, sample
from glance_runtime.errors import GlanceError, InputError
from support import cuda_unavailable

pytestmark = pytest.mark.edge  # needs no torch

# (seed, position, token) -> G, as tests/runtime/decode/test_sampling.py pins it
GOLDEN = {(0, 0, 0): 0.8509171899612384, (42, 7, 151935): 2.9226334014504096,
          (2**63 - 1, 10**6, 3): 1.874205293709447, (1, 0, 1): 4.03723791994817}


def compiler() -> str | None:
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    """The kernel source built for the CPU as a shared library (IEEE arithmetic: no fused multiply-adds)."""
    cxx = compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH to build the kernel's host form")
    folder = tmp_path_factory.mktemp("device_sampling")
    (folder / "kernel.cpp").write_text(SOURCE)
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-o",
                    str(folder / "kernel.so"), str(folder / "kernel.cpp")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(folder / "kernel.so"))
    getattr(lib, HOST_ENTRY).restype = None  # no argtypes: it takes kernel_args' C values as a launch does
    lib.glance_gumbel_host.restype = ctypes.c_double
    lib.glance_gumbel_host.argtypes = [ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_int]
    return lib


def host_choose(lib, logits: np.ndarray, rows, positions, params: SamplingParams, top_n: int) -> Chosen:
    """DeviceSampler.choose with the kernel's host build: the same checks, arguments, output layout and unpacking."""
    logits = np.ascontiguousarray(logits, np.float32)
    rows, positions = check_call(logits.shape, rows, positions, params, top_n)
    inputs = np.concatenate([rows, positions])
    out = np.zeros(out_bytes(len(rows), top_n), np.uint8)
    vocab = logits.shape[1]
    getattr(lib, HOST_ENTRY)(*kernel_args(logits.ctypes.data, vocab, inputs.ctypes.data, len(rows), params, top_n,
                                          out.ctypes.data))
    return unpack(out, rows, top_n, vocab)


def assert_equal_to_numpy(chosen: Chosen, logits: np.ndarray, positions: np.ndarray, params: SamplingParams,
                          top_n: int) -> None:
    tokens = sample(logits, positions, params)
    expected = logprobs(logits, tokens, top_n)
    assert chosen.tokens.tolist() == tokens.tolist(), params
    assert chosen.top_ids.tolist() == expected.top_ids.tolist(), (params, top_n)
    np.testing.assert_allclose(chosen.logprob, expected.chosen, rtol=0, atol=1e-5)
    np.testing.assert_allclose(chosen.top, expected.top, rtol=0, atol=1e-5)


def rows_of_every_kind(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Spread, integer (ties everywhere), very peaked, flat, all equal, and half-steps with -inf and both zeros."""
    logits = rng.normal(0, 2, (6, vocab)).astype(np.float32)
    logits[1] = np.round(logits[1])
    logits[2, rng.integers(vocab)] += 14
    logits[3] *= 0.02
    logits[4] = 1.5
    logits[5] = np.round(logits[5] * 2) / 2
    logits[5, 1::3] = -np.inf
    logits[5, ::4] = -0.0
    logits[5, 0] = 0.0
    return logits


TRUNCATIONS = [dict(top_k=k, top_p=p, min_p=m) for k, p, m in itertools.product((0, 1, 5, 50), (1.0, 0.9, 0.4),
                                                                                 (0.0, 0.05, 0.3))]


@pytest.mark.parametrize("vocab", [1, 2, 7, 33, 257, 1000])
def test_every_truncation_and_temperature_equals_numpy(host_kernel, vocab):
    """Top-k, top-p and min-p alone and in every combination, at three temperatures and greedy, over rows of every
    kind (picked out of order, one twice), with 0, 1, 8 and 20 top log-probs: tokens and top ids exactly."""
    rng = np.random.default_rng(vocab)
    logits = rows_of_every_kind(rng, vocab)
    rows = np.array([5, 0, 1, 2, 3, 4, 1])
    positions = rng.integers(0, 100, len(rows))
    settings = [SamplingParams()] + [SamplingParams(temperature, seed=int(rng.integers(2**63)), **cut)
                                     for temperature in (0.4, 1.0, 2.5) for cut in TRUNCATIONS]
    for params, top_n in itertools.product(settings, (0, 1, 8, 20)):
        chosen = host_choose(host_kernel, logits, rows, positions, params, top_n)
        assert_equal_to_numpy(chosen, logits[rows], positions, params, top_n)


def test_any_settings_equal_numpy(host_kernel):
    """Random settings over the whole accepted range (temperature 1e-6 to 100, top-p down to 1e-9, min-p to 0.999)
    on peaked to flat rows with ties."""
    rng = np.random.default_rng(2024)
    for _ in range(800):
        vocab = int(rng.choice([3, 40, 600, 3000]))
        params = SamplingParams(float(np.exp(rng.uniform(np.log(1e-6), np.log(100)))),
                                float(rng.choice([1.0, rng.uniform(1e-9, 1)])), int(rng.choice([0, rng.integers(81)])),
                                float(rng.choice([0.0, rng.uniform(0, 0.999)])), int(rng.integers(2**63))).check()
        logits = rng.normal(0, rng.uniform(0.1, 6), (4, vocab)).astype(np.float32)
        logits[0, rng.integers(vocab)] += rng.uniform(0, 12)
        logits[3] = np.round(logits[3])
        positions = rng.integers(0, 50, 4)
        top_n = int(rng.choice([0, 1, 8, 20]))
        chosen = host_choose(host_kernel, logits, np.arange(4), positions, params, top_n)
        assert_equal_to_numpy(chosen, logits, positions, params, top_n)


def test_a_full_vocabulary_equals_numpy(host_kernel):
    """Qwen2.5-VL's 151,936 tokens: peaked, integer and flat rows under the settings a server sees."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, (3, 151_936)).astype(np.float32)
    logits[0, 17] += 25
    logits[1] = np.round(logits[1])
    logits[2] *= 0.01
    positions = np.array([0, 9, 1000])
    for params in (SamplingParams(), SamplingParams(1.0, seed=3), SamplingParams(0.7, 0.9, 50, seed=4),
                   SamplingParams(1.0, 0.95, seed=5), SamplingParams(1.3, min_p=0.05, seed=6),
                   SamplingParams(0.8, 0.9, 40, 0.1, seed=8)):
        chosen = host_choose(host_kernel, logits, np.arange(3), positions, params, 20)
        assert_equal_to_numpy(chosen, logits, positions, params, 20)


def test_exact_boundaries_fill_ties_by_lowest_id(host_kernel):
    """Top-p stops at the first prefix reaching top_p; top-k and top_n cut inside a run of ties keep its lowest ids."""
    even = np.zeros((1, 4), np.float32)
    drawn = {int(host_choose(host_kernel, even, [0], [p], SamplingParams(1.0, top_p=0.5, seed=2), 0).tokens[0])
             for p in range(200)}
    assert drawn == {0, 1}
    ties = np.zeros((1, 50), np.float32)
    ties[0, 40:] = 1.0
    drawn = {int(host_choose(host_kernel, ties, [0], [p], SamplingParams(1.0, top_k=13, seed=4), 0).tokens[0])
             for p in range(300)}
    assert drawn == set(range(40, 50)) | {0, 1, 2}
    assert host_choose(host_kernel, ties, [0], [0], SamplingParams(), 12).top_ids.tolist() == \
        [list(range(40, 50)) + [0, 1]]


def test_noise_is_the_pinned_hash(host_kernel):
    for (seed, position, token), g in GOLDEN.items():
        assert host_kernel.glance_gumbel_host(seed, position, token) == g


def test_bad_rows_and_calls_are_one_line(host_kernel):
    logits = np.zeros((3, 10), np.float32)
    logits[1, 3] = np.nan
    logits[2, 4] = np.inf
    for row in (1, 2):
        with pytest.raises(GlanceError, match=f"row {row} are NaN or infinite") as caught:
            host_choose(host_kernel, logits, [0, row], [0, 1], SamplingParams(1.0, seed=1), 0)
        assert "\n" not in str(caught.value)
    assert host_choose(host_kernel, logits, [0], [0], SamplingParams(1.0, seed=1), 0).tokens.shape == (1,)
    for call in (lambda: host_choose(host_kernel, logits, [3], [0], SamplingParams(), 0),
                 lambda: host_choose(host_kernel, logits, [0], [0], SamplingParams(), 21),
                 lambda: host_choose(host_kernel, logits, [0], [0], SamplingParams(1.0), 0)):
        with pytest.raises(InputError):
            call()


@pytest.mark.parametrize("arch", ["sm_87", "sm_90"])
def test_the_source_compiles_for_the_device(tmp_path, arch):
    """Jetson Orin and Hopper, with the options the runtime gives NVRTC (no fused multiply-adds)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH, so the device compile of the kernel cannot be checked here")
    (tmp_path / "kernel.cu").write_text(SOURCE)
    done = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-fmad=false", "-ftz=false", "-prec-div=true", "-o",
                           str(tmp_path / "kernel.cubin"), str(tmp_path / "kernel.cu")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "kernel.cubin").stat().st_size > 0


def test_nvrtc_builds_the_kernel_or_the_refusal_names_the_fix():
    """With NVRTC (the system's or a pip wheel's) the runtime's own compile gives a CUBIN for Orin; without it the
    caller gets one line saying how to install it, and falls back to the host."""
    try:
        _nvrtc()
    except GlanceError as exc:
        assert "pip install nvidia-cuda-nvrtc-cu12" in str(exc) and "\n" not in str(exc)
        with pytest.raises(GlanceError, match="NVRTC"):
            compile_kernel("8.7")
        return
    assert compile_kernel("8.7")[:4] == b"\x7fELF"


NO_CUDA = cuda_unavailable()


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA is not None, reason=f"no CUDA buffers here: {NO_CUDA}")
def test_device_sampler_on_cuda_equals_numpy():
    """The real thing: NVRTC, the driver and the stream, on CUDA memory; only the small outputs cross the bus."""
    from glance_runtime.backends.device_buffers import CudaDevice

    device = CudaDevice()
    sampler = DeviceSampler(device)
    rng = np.random.default_rng(11)
    try:
        for vocab in (257, 151_936):
            logits = rows_of_every_kind(rng, vocab)
            buffer = device.empty(logits.shape, np.float32)
            device.upload(buffer.rows(len(logits)), logits)
            rows = np.array([5, 0, 1, 2, 3, 4, 1])
            positions = rng.integers(0, 100, len(rows))
            settings = [SamplingParams()] + [SamplingParams(0.8, seed=seed, **cut)
                                             for seed, cut in enumerate(TRUNCATIONS)]
            for i, params in enumerate(settings):
                top_n = (0, 1, 8, 20)[i % 4]
                device.traffic.reset()
                chosen = sampler.choose(buffer.rows(len(logits)), rows, positions, params, top_n)
                assert device.traffic.d2h_bytes == out_bytes(len(rows), top_n)
                assert_equal_to_numpy(chosen, logits[rows], positions, params, top_n)
            device.free(buffer)
    finally:
        sampler.close()


class HostKernel:
    """`DeviceSampler`'s interface over the kernel's host build, reading the logits where a HostDevice keeps them:
    what a graph backend's draws do on a GPU, run here (only the launch and the copies differ)."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def load(self) -> None:
        pass

    def choose(self, logits, rows, positions, params: SamplingParams, top_n: int = 0) -> Chosen:
        rows, positions = check_call(tuple(logits.shape), rows, positions, params, top_n)
        vocab = int(logits.shape[1])
        inputs = np.concatenate([rows, positions])
        out = np.zeros(out_bytes(len(rows), top_n), np.uint8)
        getattr(self.lib, HOST_ENTRY)(*kernel_args(logits.ptr, vocab, inputs.ctypes.data, len(rows), params, top_n,
                                                   out.ctypes.data))
        self.calls += 1
        return unpack(out, rows, top_n, vocab)

    def close(self) -> None:
        pass


def test_graph_backends_drawing_with_the_kernel_decode_as_on_the_host(host_kernel):
    """The shipped default on ONNX Runtime, its draws made by the kernel (as on a GPU) against numpy's: the same
    tokens and reports, plain and speculative, greedy with log-probs and sampled under each truncation, alone and in
    a batch."""
    from glance_runtime.backends.batch_rounds import BatchRounds
    from glance_runtime.backends.ort_backend import OrtBackend
    from glance_runtime.backends.row_draws import RowDraws
    from glance_runtime.decode.batch_loop import BatchLoop, Request
    from glance_runtime.decode.loop import DecodeConfig, decode
    from glance_runtime.defaults import DEFAULT_ARTIFACTS
    from glance_runtime.prompt.codec import exported_codec
    from glance_runtime.prompt.messages import user_turn

    host, kernel = OrtBackend(DEFAULT_ARTIFACTS, threads=1), OrtBackend(DEFAULT_ARTIFACTS, threads=1, max_batch=3)
    sampler = HostKernel(host_kernel)
    kernel.draws = RowDraws(kernel.device, sampler)
    codec = exported_codec(host.manifest)
    prompts = [codec.encode([user_turn(text, [])]) for text in ("Describe a day at the sea.", "Count to nine.")]
    settings = [SamplingParams()] + [SamplingParams(1.3, seed=40 + i, **cut) for i, cut in enumerate(TRUNCATIONS[::5])]
    try:
        for i, params in enumerate(settings):
            for budget, spec in ((0, False), (15, True)):
                cfg = DecodeConfig(max_new_tokens=16, budget=budget, speculative=spec, sampling=params, logprobs=3)
                want, got = decode(host, prompts[i % 2], cfg), decode(kernel, prompts[i % 2], cfg)
                assert got.tokens == want.tokens, (params, budget)
                assert [[t for t, _ in r.top] for r in got.logprobs] == [[t for t, _ in r.top] for r in want.logprobs]
                np.testing.assert_allclose([[r.logprob, *(v for _, v in r.top)] for r in got.logprobs],
                                           [[r.logprob, *(v for _, v in r.top)] for r in want.logprobs], atol=1e-5)
        cfgs = [DecodeConfig(max_new_tokens=16, budget=7, sampling=p, logprobs=2) for p in settings[:3]]
        alone = [decode(host, prompts[i % 2], cfg) for i, cfg in enumerate(cfgs)]
        batched = BatchLoop(BatchRounds(kernel)).run([Request(prompts[i % 2], cfg) for i, cfg in enumerate(cfgs)])
        assert [r.tokens for r in batched] == [r.tokens for r in alone]
        assert [[t for t, _ in r.top] for out in batched for r in out.logprobs] == \
            [[t for t, _ in r.top] for out in alone for r in out.logprobs]
    finally:
        host.close()
        kernel.close()
    assert sampler.calls > 0
