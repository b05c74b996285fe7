"""KVCache: zero-copy views, append/compact against a plain-list model, bounded memory, clear errors."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from glance_runtime.errors import GlanceError
from glance_runtime.kv_cache import KVCache


def _rows(rng, t, layers=2, kvh=2, d=4):
    return [rng.standard_normal((t, kvh, d)).astype(np.float32) for _ in range(2 * layers)]


def test_views_share_memory_and_are_contiguous():
    cache = KVCache(layers=2, kv_heads=2, head_dim=4, max_context=16)
    cache.append(_rows(np.random.default_rng(0), 5))
    views = cache.view()
    assert len(views) == 4 and all(v.shape == (5, 2, 4) for v in views)
    for view, buf in zip(views, cache.buffers):
        assert np.shares_memory(view, buf) and view.flags.c_contiguous
    assert cache.view(0)[0].shape == (0, 2, 4)


def test_matches_list_model_over_many_rounds():
    """Random prefills, tree appends and compactions agree with a list of rows doing the same."""
    rng = np.random.default_rng(1)
    cache = KVCache(layers=2, kv_heads=2, head_dim=4, max_context=400)
    model: list[list[np.ndarray]] = [[] for _ in range(4)]
    prompt = _rows(rng, 7)
    cache.append(prompt)
    for m, p in zip(model, prompt):
        m.extend(p)
    for _ in range(60):
        t = int(rng.integers(1, 12))
        block = _rows(rng, t)
        cache.append(block)
        keep = np.concatenate([[0], np.sort(rng.choice(np.arange(1, t), size=rng.integers(0, t), replace=False))]
                              ) if t > 1 else np.array([0])
        cache.compact(keep.astype(np.int64))
        for m, b in zip(model, block):
            m.extend(b[keep])
        assert cache.length == len(model[0])
        for view, m in zip(cache.view(), model):
            np.testing.assert_array_equal(view, np.stack(m))


def test_compact_moves_only_kept_rows():
    cache = KVCache(layers=1, kv_heads=1, head_dim=1, max_context=10)
    cache.append([np.arange(3, dtype=np.float32).reshape(3, 1, 1)] * 2)
    cache.append([np.arange(10, 15, dtype=np.float32).reshape(5, 1, 1)] * 2)
    cache.compact(np.array([0, 1, 3]))
    assert cache.length == 6
    np.testing.assert_array_equal(cache.view()[0].ravel(), [0, 1, 2, 10, 11, 13])
    # rows past the committed length keep their stale values: nothing beyond the kept rows was written
    np.testing.assert_array_equal(cache.buffers[0][6:8].ravel(), [13, 14])


def test_memory_does_not_grow():
    rng = np.random.default_rng(2)
    cache = KVCache(layers=4, kv_heads=2, head_dim=16, max_context=4096)
    blocks = [_rows(rng, 9, layers=4, d=16) for _ in range(4)]
    keep = np.array([0, 1, 2, 5])

    def rounds(n):
        for i in range(n):
            cache.append(blocks[i % 4])
            cache.compact(keep)
            if cache.length > 4000:
                cache.clear()

    rounds(50)  # warm any allocator caches
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    rounds(2000)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert growth < 64 * 1024, f"memory grew by {growth} bytes over 2000 rounds"
    assert all(b.shape == (4096, 2, 16) for b in cache.buffers)


def test_max_context_errors():
    cache = KVCache(layers=1, kv_heads=1, head_dim=2, max_context=8)
    with pytest.raises(GlanceError, match="prompt longer than --max-context 8"):
        cache.append(_rows(np.random.default_rng(0), 9, layers=1, kvh=1, d=2))
    cache.append(_rows(np.random.default_rng(0), 6, layers=1, kvh=1, d=2))
    with pytest.raises(GlanceError, match="--max-context 8"):
        cache.check_room(3)
    cache.check_room(2)


def test_compact_rejects_bad_rows():
    cache = KVCache(layers=1, kv_heads=1, head_dim=1, max_context=8)
    cache.append([np.zeros((4, 1, 1), np.float32)] * 2)
    with pytest.raises(ValueError):
        cache.compact(np.array([0, 2, 1]))
    with pytest.raises(ValueError):
        cache.compact(np.array([0, 4]))
