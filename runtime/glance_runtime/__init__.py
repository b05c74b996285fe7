"""GLANCE runtime: the draft/verify loop and its backends; the ONNX Runtime path needs no torch.

`__version__` is the installed distribution's (pyproject.toml is its one source): the version every
writer stamps into a file and every reader checks."""
from importlib.metadata import version

__version__ = version("glance-toolkit")

from .api import Chat, Model, Output, load  # noqa: E402  (after __version__: the API's modules read it)
from .errors import GlanceError, InputError, IntegrityError, LimitError  # noqa: E402

__all__ = ["Chat", "GlanceError", "InputError", "IntegrityError", "LimitError", "Model", "Output", "load"]
