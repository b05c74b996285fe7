"""The export's default batch size, importable without torch (the CLI's flag defaults read it)."""
from __future__ import annotations

MAX_BATCH = 16  # sequences one pass of the target and draft graphs serves at most, by default (`--max-batch`)
