"""ONNX export of the target, draft and vision graphs, with graph-level validation in ONNX Runtime."""
from .artifacts import export_artifacts, validate_artifacts
from .vision_indices import vision_index_inputs

__all__ = ["export_artifacts", "validate_artifacts", "vision_index_inputs"]
