"""What the runtime uses from the export side without importing it: the torch reference and export on first use.

Imports run one way: `glance_export` builds on `glance_runtime`, never the reverse, so an edge install
(no torch, no export package) imports every runtime module. The two things the runtime cannot do itself
are registered by the export package as entry points of the group below (see pyproject.toml) and found
through the installed package metadata; an install without them gets a one-line fix naming the extra.

Registration rather than moving the torch backend into the runtime: the torch reference is built from the
same adapters and head modules the graphs are exported from, so keeping it with them keeps one copy of
that model code, and the runtime holds no torch code at all.
"""
from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

from ..decode.loop import DecodeConfig
from ..decode.session import Session, Settings
from ..errors import GlanceError

GROUP = "glance_runtime.extensions"
REFERENCE = "torch-reference"  # (model, head, settings=, progress=) -> Session: the torch backend and its oracle
EXPORT = "export"  # (model, head, out, progress=) -> Path: an artifacts directory
INSTALL = "pip install 'glance-toolkit[export]' (from a clone: pip install -e '.[export]', which registers it)"


def _load(name: str, needed_for: str) -> Callable[..., Any]:
    """The registered callable `name`, or a one-line refusal: none registered, or its stack is missing."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise GlanceError(f"{needed_for} needs the export extra, which this install lacks: {INSTALL}")
    try:
        return found[0].load()
    except ImportError as exc:
        raise GlanceError(f"{needed_for} needs the export extra ({exc.name or 'a module'} is missing): "
                          f"{INSTALL}") from None


def torch_session(model: Path, head: Path | None, settings: Settings | DecodeConfig = Settings(),
                  progress: Callable[[str], None] = lambda _: None) -> Session:
    """The torch reference backend on the snapshot `model` (with the draft head `head`), its codec and greedy
    oracle."""
    return _load(REFERENCE, "the torch backend")(model, head, settings=settings, progress=progress)


def export(model: Path, head: Path, out: Path, progress: Callable[[str], None]) -> Path:
    """Export (model, head) to an artifacts directory at `out` (the runtime's export cache)."""
    exporter = _load(EXPORT, "exporting without --artifacts (or pass --artifacts DIR)")
    progress(f"exporting {model} + {head} to {out} (once; later runs reuse it)")
    return exporter(model, head, out, progress=progress)
