"""KVCache on the device layer (host memory here): in-place views, append/compact against a plain-list
model, one strided copy per moved row, bounded memory, clear errors."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from glance_runtime.backends.device_buffers import HostDevice
from glance_runtime.errors import GlanceError
from glance_runtime.backends.kv_cache import KVCache

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too


def _cache(layers=2, kvh=2, d=4, max_context=16) -> KVCache:
    return KVCache(HostDevice(), layers, kvh, d, max_context)


def _append(cache: KVCache, blocks: list[np.ndarray]) -> None:
    """What a graph pass does: write its rows where `new_rows` points, then report them."""
    for view, block in zip(cache.new_rows(len(blocks[0])), blocks):
        cache.device.upload(view, block)
    cache.appended(len(blocks[0]))


def _rows(rng, t, layers=2, kvh=2, d=4):
    return [rng.standard_normal((t, kvh, d)).astype(np.float32) for _ in range(2 * layers)]


def test_views_are_contiguous_blocks_of_one_allocation():
    cache = _cache()
    _append(cache, _rows(np.random.default_rng(0), 5))
    past = cache.past()
    assert len(past) == 4 and all(t.shape == (5, 2, 4) and t.buffer is cache.buffer for t in past)
    assert [t.offset for t in past] == [s * 16 * cache.row_bytes for s in range(4)]
    new = cache.new_rows(3)
    assert [t.offset - p.offset for t, p in zip(new, past)] == [5 * cache.row_bytes] * 4


def test_matches_list_model_over_many_rounds():
    """Random prefills, tree appends and compactions agree with a list of rows doing the same."""
    rng = np.random.default_rng(1)
    cache = _cache(max_context=400)
    model: list[list[np.ndarray]] = [[] for _ in range(4)]
    prompt = _rows(rng, 7)
    _append(cache, prompt)
    for m, p in zip(model, prompt):
        m.extend(p)
    for _ in range(60):
        t = int(rng.integers(1, 12))
        block = _rows(rng, t)
        _append(cache, block)
        keep = np.concatenate([[0], np.sort(rng.choice(np.arange(1, t), size=rng.integers(0, t), replace=False))]
                              ) if t > 1 else np.array([0])
        cache.compact(keep.astype(np.int64))
        for m, b in zip(model, block):
            m.extend(b[keep])
        assert cache.length == len(model[0])
        for view, m in zip(cache.host_view(), model):
            np.testing.assert_array_equal(view, np.stack(m))


def test_compact_moves_only_kept_rows_one_copy_each():
    cache = _cache(layers=1, kvh=1, d=1, max_context=10)
    _append(cache, [np.arange(3, dtype=np.float32).reshape(3, 1, 1)] * 2)
    _append(cache, [np.arange(10, 15, dtype=np.float32).reshape(5, 1, 1)] * 2)
    cache.device.traffic.reset()
    cache.compact(np.array([0, 1, 3]))
    assert cache.length == 6 and cache.device.traffic.calls == 1  # rows 0 and 1 stay; row 3 moves in every slot
    np.testing.assert_array_equal(cache.host_view()[0].ravel(), [0, 1, 2, 10, 11, 13])
    # rows past the committed length keep their stale values: nothing beyond the kept rows was written
    np.testing.assert_array_equal(cache.buffer.host[0, 6:8].ravel(), [13, 14])
    assert cache.device.traffic.h2d_bytes == cache.device.traffic.d2h_bytes - 6 * 8 == 0


def test_memory_does_not_grow():
    rng = np.random.default_rng(2)
    cache = KVCache(HostDevice(), 4, 2, 16, 4096)
    blocks = [_rows(rng, 9, layers=4, d=16) for _ in range(4)]
    keep = np.array([0, 1, 2, 5])

    def rounds(n):
        for i in range(n):
            _append(cache, blocks[i % 4])
            cache.compact(keep)
            if cache.length > 4000:
                cache.clear()

    rounds(500)  # fill the interpreter's free lists (tuples, ints) before measuring
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    rounds(2000)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert growth < 64 * 1024, f"memory grew by {growth} bytes over 2000 rounds"
    assert cache.buffer.shape == (8, 4096, 2, 16)


def test_max_context_errors():
    cache = _cache(layers=1, kvh=1, d=2, max_context=8)
    with pytest.raises(GlanceError, match="prompt longer than --max-context 8"):
        cache.new_rows(9)
    _append(cache, _rows(np.random.default_rng(0), 6, layers=1, kvh=1, d=2))
    with pytest.raises(GlanceError, match="--max-context 8"):
        cache.check_room(3)
    cache.check_room(2)


def test_compact_rejects_bad_rows():
    cache = _cache(layers=1, kvh=1, d=1, max_context=8)
    _append(cache, [np.zeros((4, 1, 1), np.float32)] * 2)
    with pytest.raises(ValueError):
        cache.compact(np.array([0, 2, 1]))
    with pytest.raises(ValueError):
        cache.compact(np.array([0, 4]))
