"""Run code the way a Jetson install would: no torch, transformers, safetensors or glance_export."""
from __future__ import annotations


def blocking(*packages: str) -> str:
    """A prelude that makes importing any of `packages` (or their submodules) fail."""
    return f"""
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {packages!r}:
            raise ImportError(f"{{name}} is blocked: an edge install has no training stack")
        return None

sys.meta_path.insert(0, Blocker())
"""


BLOCK_TRAINING_STACK = blocking("torch", "transformers", "glance_export", "safetensors")
# `glance-export build --artifacts` on a device: the toolkit's edge install plus TensorRT, no export stack.
BLOCK_EXPORT_STACK = blocking("torch", "transformers", "safetensors", "onnx", "onnxscript", "polygraphy")
