"""The runtime's vision index inputs equal the exporter's for every family and many grid shapes."""
from __future__ import annotations

import numpy as np
import pytest

from glance_export.onnx import vision_indices as exporter
from glance_runtime import vision_indices as runtime

PARAMS = {"qwen2_vl": {"family": "qwen2_vl", "merge_size": 2, "patch_size": 14},
          "qwen2_5_vl": {"family": "qwen2_5_vl", "merge_size": 2, "patch_size": 14, "window_size": 112},
          "qwen3_vl": {"family": "qwen3_vl", "merge_size": 2, "patch_size": 16, "grid_per_side": 48}}


@pytest.mark.parametrize("family", sorted(PARAMS))
@pytest.mark.parametrize("grid", [(1, 2, 2), (1, 4, 6), (1, 18, 4), (1, 34, 50), (1, 2, 60)])
def test_runtime_indices_equal_exporter(family, grid):
    ours = runtime.vision_index_inputs(np.array([grid]), PARAMS[family])
    theirs = exporter.vision_index_inputs(np.array([grid]), PARAMS[family])
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype
        np.testing.assert_array_equal(ours[name], theirs[name])
