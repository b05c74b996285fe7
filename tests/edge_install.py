"""Run code the way a Jetson install would: no torch, transformers, safetensors or glance_export."""
from __future__ import annotations

BLOCK_TRAINING_STACK = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "glance_export", "safetensors"):
            raise ImportError(f"{name} is blocked: an edge install has no training stack")
        return None

sys.meta_path.insert(0, Blocker())
"""
