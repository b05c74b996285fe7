"""The device layer's contract, checked on every implementation this machine has: host memory always,
CUDA where a GPU is present (the same tests, so the CPU path CI runs is the GPU path's model)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from glance_runtime.backends.device_buffers import CudaDevice, HostDevice
from support import blocking, cuda_unavailable

NO_CUDA = cuda_unavailable()
DEVICES = [pytest.param(HostDevice, id="host"),
           pytest.param(CudaDevice, id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               NO_CUDA is not None, reason=f"no CUDA buffers here: {NO_CUDA}")])]


@pytest.mark.edge
@pytest.mark.parametrize("make", DEVICES)
def test_upload_download_round_trip_and_traffic(make):
    device = make()
    buf = device.empty((4, 3), np.float32)
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    device.upload(buf.rows(2, 1), data)
    np.testing.assert_array_equal(device.download(buf.rows(2, 1)), data)
    assert device.traffic.h2d_bytes == device.traffic.d2h_bytes == data.nbytes


@pytest.mark.edge
@pytest.mark.parametrize("make", DEVICES)
def test_copies_stay_on_the_device(make):
    device = make()
    src, dst = device.empty((3, 2), np.int64), device.empty((3, 2), np.int64)
    device.upload(src.rows(3), np.arange(6).reshape(3, 2))
    device.traffic.reset()
    device.copy(dst.rows(1, 2), src.rows(1, 0))
    assert device.traffic.h2d_bytes == device.traffic.d2h_bytes == 0 and device.traffic.d2d_bytes == 16
    np.testing.assert_array_equal(device.download(dst.rows(1, 2)), [[0, 1]])


@pytest.mark.edge
@pytest.mark.parametrize("make", DEVICES)
def test_copy_2d_moves_one_row_in_every_slab(make):
    """What KV compaction relies on: row 3 -> row 1 of each of 4 slabs, in one call."""
    device = make()
    buf = device.empty((4, 5, 2), np.float32)
    data = np.arange(40, dtype=np.float32).reshape(4, 5, 2)
    device.upload(buf.tensor(buf.shape), data)
    device.traffic.reset()
    row = 2 * 4
    device.copy_2d(buf, 1 * row, 3 * row, row, 4, 5 * row)
    expected = data.copy()
    expected[:, 1] = data[:, 3]
    np.testing.assert_array_equal(device.download(buf.tensor(buf.shape)), expected)
    assert device.traffic.d2d_bytes == 4 * row and device.traffic.calls == 1 + 2  # the copy, then the download


@pytest.mark.edge
def test_views_refuse_to_leave_their_buffer():
    buf = HostDevice().empty((2, 2), np.float32)
    with pytest.raises(ValueError, match="exceeds"):
        buf.rows(3)
    with pytest.raises(ValueError, match="upload of"):
        buf.device.upload(buf.rows(1), np.zeros(3, np.float32))


@pytest.mark.skipif(NO_CUDA is None, reason="checks the refusal on a machine without a usable GPU")
def test_no_gpu_is_one_line():
    assert NO_CUDA is not None and "\n" not in NO_CUDA and ("CUDA" in NO_CUDA)


@pytest.mark.edge
def test_without_polygraphy_the_refusal_names_it_and_the_gpu_extra():
    """An edge install without the gpu extra: the refusal (and so a GPU test's skip reason) says what is missing
    and how to get it, not that there is no GPU."""
    code = blocking("polygraphy") + """
from glance_runtime.backends.device_buffers import CudaDevice
from glance_runtime.errors import GlanceError
try:
    CudaDevice()
except GlanceError as exc:
    print(exc)
"""
    refusal = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
    assert "polygraphy" in refusal and "'.[gpu]'" in refusal and "\n" not in refusal
