"""GLANCE runtime: the draft/verify loop and its backends; the ONNX Runtime path needs no torch."""

__version__ = "0.1.0"

from .api import Chat, Model, Output, load  # noqa: E402  (the API modules read __version__ through runner)
from .errors import GlanceError, InputError, IntegrityError, LimitError  # noqa: E402

__all__ = ["Chat", "GlanceError", "InputError", "IntegrityError", "LimitError", "Model", "Output", "load"]
