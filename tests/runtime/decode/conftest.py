"""Fixtures the decode tests share."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def backend_for(snapshot_dir):
    """(family, block_size) -> the torch reference on the family's tiny snapshot with a random one-layer head (made
    once per module). Imported here, not at the top: the edge install collects this directory without torch."""
    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import head_config_for, init_head, pick_mask_token
    from glance_export.model.torch_backend import TorchBackend

    cache: dict[tuple[str, int], TorchBackend] = {}

    def get(family: str, block_size: int = 8) -> TorchBackend:
        if (family, block_size) not in cache:
            snap = Snapshot(snapshot_dir(family))
            head = init_head(head_config_for(snap, 1, block_size, pick_mask_token(snap)), seed=block_size)
            cache[family, block_size] = TorchBackend(snap, head)
        return cache[family, block_size]

    return get
