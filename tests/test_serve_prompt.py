"""The server's conversation renderer gives the runtime's own prompt for a single user turn, ids and pixels."""
from __future__ import annotations

import numpy as np
from PIL import Image

from glance_runtime.defaults import default_artifacts
from glance_runtime.preprocess import PromptBuilder
from glance_runtime.manifest import load_manifest
from glance_runtime.serve.engine import _render
from serve_helpers import RECEIPT


def test_a_single_turn_renders_as_the_runtime_builds_it():
    manifest = load_manifest(default_artifacts())
    builder = PromptBuilder(manifest.path, manifest.image_token_id)
    image = Image.open(RECEIPT)
    for img in (image, None):
        content = ([{"type": "image", "image": img}] if img else []) + [{"type": "text", "text": "What is the total?"}]
        got = _render(builder, [{"role": "user", "content": content}], img)
        want = builder.build("What is the total?", img)
        assert np.array_equal(got.input_ids, want.input_ids)
        if img:
            assert np.array_equal(got.pixel_values, want.pixel_values)
            assert np.array_equal(got.image_grid_thw, want.image_grid_thw)
