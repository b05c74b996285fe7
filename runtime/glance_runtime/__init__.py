"""GLANCE runtime: the draft/verify loop and its backends; the ONNX Runtime path needs no torch.

`__version__` is pyproject.toml's, the one source: the installed distribution's metadata, or where this
source tree is used without an install (on `sys.path`, as Triton's Python-backend stubs load it) the
checkout's pyproject itself. It is the version every writer stamps into a file and every reader checks."""


def _version() -> str:
    """Imports kept inside, so `glance_runtime` exposes only its API (`dir(gr)`)."""
    import re
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        return version("glance-toolkit")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        if found is None:
            raise
        return found.group(1)


__version__ = _version()

from .api import Chat, Model, Output, Stream, load  # noqa: E402  (after __version__: the API's modules read it)
from .errors import GlanceError, InputError, IntegrityError, LimitError  # noqa: E402

__all__ = ["Chat", "GlanceError", "InputError", "IntegrityError", "LimitError", "Model", "Output", "Stream", "load"]
