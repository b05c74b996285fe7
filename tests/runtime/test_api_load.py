"""Loading cheaply: ONNX Runtime sessions opened from the cache's optimised copies compute exactly what
sessions optimised on the spot compute, a damaged copy is rebuilt rather than run, and graphs the cache does
not take (no usable cache) open as usual."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.prompt.codec import exported_codec
from glance_runtime.prompt.messages import user_turn

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

ROOT = Path(__file__).resolve().parents[2]
RECEIPT = ROOT / "examples" / "demo" / "receipt.png"


def _run(backend: OrtBackend) -> tuple[list[int], np.ndarray]:
    """A decode's tokens, and the prefill's hidden rows bit for bit (the tokens alone could hide drift)."""
    prompt = exported_codec(backend.manifest).encode([user_turn("What is the total?", [RECEIPT])])
    tokens = decode(backend, prompt, DecodeConfig(max_new_tokens=12, budget=15, branch_k=8),
                    backend.manifest.stop_token_ids).tokens
    backend.prefill(prompt)
    hidden = backend.device.download(backend.hidden.rows(prompt.length)).copy()
    backend.close()
    return tokens, hidden


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "ort").glob("*.ort")) if (cache / "ort").is_dir() else []


def test_cached_sessions_compute_the_same(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path / "file" / "cache"))  # unusable: graphs open as usual
    plain = _run(OrtBackend(DEFAULT_ARTIFACTS))
    cache = tmp_path / "cache"
    monkeypatch.setenv("GLANCE_CACHE", str(cache))
    building = _run(OrtBackend(DEFAULT_ARTIFACTS))
    entries = _entries(cache)
    assert len(entries) == 4  # target, draft, vocab, vision
    stamps = {p: p.stat().st_mtime_ns for p in entries}
    cached = _run(OrtBackend(DEFAULT_ARTIFACTS))
    assert {p: p.stat().st_mtime_ns for p in _entries(cache)} == stamps  # opened from the copies, not rebuilt
    for run in (building, cached):
        assert run[0] == plain[0]
        np.testing.assert_array_equal(run[1], plain[1])


def test_a_damaged_copy_is_rebuilt(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("GLANCE_CACHE", str(cache))
    first = _run(OrtBackend(DEFAULT_ARTIFACTS))
    victim = max(_entries(cache), key=lambda p: p.stat().st_size)  # the target graph's copy
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside its weights: a copy that may still open, and would answer wrongly
    victim.write_bytes(bytes(data))
    again = _run(OrtBackend(DEFAULT_ARTIFACTS))
    assert again[0] == first[0]
    np.testing.assert_array_equal(again[1], first[1])
    assert bytes(data) != victim.read_bytes()  # rewritten from the verified graph


def test_large_graphs_are_not_copied(tmp_path, monkeypatch):
    """Graphs over the size bound open as usual and leave nothing in the cache."""
    from glance_runtime.backends import ort_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("GLANCE_CACHE", str(cache))
    monkeypatch.setattr(ort_cache, "MAX_BYTES", 1 << 20)  # the default's vocab graph is the only one under it
    _run(OrtBackend(DEFAULT_ARTIFACTS))
    sizes = sorted(p.stat().st_size for p in _entries(cache))
    assert len(sizes) == 1 and sizes[0] < 1 << 20


def test_swapped_copies_are_rebuilt(tmp_path, monkeypatch):
    """Two entries swapped with their records (each still matching its own digest): each is rebuilt from
    its verified source graph, and the answer is the same."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("GLANCE_CACHE", str(cache))
    first = _run(OrtBackend(DEFAULT_ARTIFACTS))
    a, b = sorted(_entries(cache), key=lambda p: p.stat().st_size)[-2:]
    for suffix in ("", ".sha256"):
        left, right = Path(f"{a}{suffix}"), Path(f"{b}{suffix}")
        swap = left.with_name("swap")
        left.rename(swap)
        right.rename(left)
        swap.rename(right)
    again = _run(OrtBackend(DEFAULT_ARTIFACTS))
    assert again[0] == first[0]
    np.testing.assert_array_equal(again[1], first[1])


def test_a_cache_entry_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    """An export cache entry replaced by a file: refused as the cache's fault, in one line."""
    import pytest

    from glance_runtime.backends import registry
    from glance_runtime.defaults import DEFAULT_HEAD, DEFAULT_MODEL
    from glance_runtime.errors import IntegrityError

    cache = tmp_path / "cache"
    monkeypatch.setenv("GLANCE_CACHE", str(cache))
    entry = registry.export_cache_entry(DEFAULT_MODEL, DEFAULT_HEAD)
    entry.parent.mkdir(parents=True)
    entry.write_text("x")
    with pytest.raises(IntegrityError, match="cache entry .* is not a directory"):
        registry.exported_artifacts(DEFAULT_MODEL, DEFAULT_HEAD, lambda _: None)
    assert entry.read_text() == "x"
