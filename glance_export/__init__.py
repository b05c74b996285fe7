"""GLANCE export toolkit: adapters, draft head, exporters and audits (needs torch).

Shares the runtime's `__version__` (one per package, from pyproject.toml)."""
from glance_runtime._version import __version__  # noqa: F401 (the toolkit's one version)
