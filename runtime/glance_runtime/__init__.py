"""GLANCE runtime: the draft/verify loop and its backends; the ONNX Runtime path needs no torch."""

__version__ = "0.1.0"
