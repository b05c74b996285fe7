"""`glance-bench`: AR, GLANCE trees and chains measured side by side, the draftability law, and plots.

Everything here but `plots` needs numpy only, so the bench runs on an edge install (ONNX Runtime or
TensorRT, no torch); plotting needs the `bench` extra (matplotlib).
"""
