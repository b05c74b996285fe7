"""Shared fixtures: tiny snapshots of every family and images of several sizes, built once per session.

Torch-free at import, so an edge install (no torch) collects and runs the tests marked `edge`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support import make_image, make_snapshot


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """An edge run (`-m edge`) does not import the test modules that hold no edge test: on the edge install they
    would fail to import torch before any marker could deselect them."""
    if "edge" in (config.option.markexpr or "") and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_"):
        if "mark.edge" not in collection_path.read_text():
            return True
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """The models here are tiny: one torch thread is fastest, and two threads on a busy 2-core machine spin-wait
    each other into a 10x slowdown. Only where a collected test imported torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


IMAGE_SIZES = {"wide": (150, 90), "tall": (70, 130), "square": (112, 112), "large": (300, 200)}


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Exports made on first use go to a temporary cache, never the user's home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLANCE_CACHE", str(tmp_path_factory.mktemp("glance_cache")))
        yield


@pytest.fixture(scope="session")
def snapshot_dir(tmp_path_factory):
    """family -> snapshot directory (built lazily, then cached)."""
    root = tmp_path_factory.mktemp("snapshots")
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = make_snapshot(root / family, family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    return {name: make_image(root / f"{name}.png", w, h, seed=i)
            for i, (name, (w, h)) in enumerate(IMAGE_SIZES.items())}
