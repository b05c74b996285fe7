"""Backends: torch (reference), onnxruntime, tensorrt; each imported only when chosen."""
