"""ONNX export of the target, draft and vision graphs, with graph-level validation in ONNX Runtime."""
