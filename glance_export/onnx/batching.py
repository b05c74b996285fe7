"""The export's default batch size, importable without torch (the CLI's flag defaults read it)."""
from __future__ import annotations

MAX_BATCH = 16  # sequences a batched decode round runs at most, by default (`glance-export onnx --max-batch`)
