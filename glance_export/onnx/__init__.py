"""ONNX export of the target, draft and vision graphs, with graph-level validation in ONNX Runtime."""
from glance_runtime.vision_indices import vision_index_inputs

from .artifacts import export_artifacts, validate_artifacts

__all__ = ["export_artifacts", "validate_artifacts", "vision_index_inputs"]
