"""The toolkit's one version: pyproject.toml's, which every writer stamps into a file and every reader checks.

Read from the installed distribution's metadata, or where this source tree is used without an install (on
`sys.path`, as Triton's Python-backend stubs load it) from the checkout's pyproject itself. A module of its
own so that modules needing the version never import the package (and with it the whole API)."""
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _read() -> str:
    try:
        return version("glance-toolkit")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        if found is None:
            raise
        return found.group(1)


__version__ = _read()
