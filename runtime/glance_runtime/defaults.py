"""Every default the commands share, in one place: the decode settings, and the embedded model.

The embedded default model is a small Qwen2.5-VL and its GLANCE head, trained in this project and
shipped in the repository's `models/`, so a fresh install can answer without any download. Its ONNX
graphs ship too, so a torch-free edge install runs it on ONNX Runtime without exporting."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import GlanceError
from .formats.graphs import MANIFEST

AUTO = "auto"  # --budget auto: each round's tree sized from the draft's confidence and this device's costs
BUDGET = 63  # tree nodes per round besides the anchor where auto does not apply (and an audit's trees)
AUTO_MAX_NODES = 63  # auto's largest tree where the graphs set no smaller bound
EAGLE3_DEPTH = 7  # head passes (tree depth) an EAGLE-3 round drafts at most; its backends' block size is one more
BRANCH_K = 8  # top-k per draft offset (and the export's: what a draft graph returns)
BLOCK_SLACK = 2  # mask rows a draft runs past the deepest it returns: the head reads the block both ways
RUN_MAX_NEW_TOKENS = 256  # glance-run's answer length
SERVE_MAX_BATCH = 8  # glance-serve's requests decoded together (--max-batch); 1 decodes one request at a time
MEASURE_MAX_NEW_TOKENS = 64  # glance-bench's and glance-export audit's answer length
DECODE_MAX_NEW_TOKENS = 128  # a DecodeConfig's answer length where its caller names none (library use, tests)

MODELS_ROOT = Path(__file__).resolve().parents[2] / "models"
DEFAULT_MODEL = MODELS_ROOT / "glance-vl-tiny"
DEFAULT_HEAD = MODELS_ROOT / "glance-vl-tiny-head"
DEFAULT_ARTIFACTS = MODELS_ROOT / "glance-vl-tiny-onnx"


def default_model() -> tuple[Path, Path]:
    """(target snapshot, head) of the embedded default, or a clear error where this install lacks it."""
    for path in (DEFAULT_MODEL, DEFAULT_HEAD):
        if not (path / "config.json").is_file():
            raise GlanceError(f"the embedded default model is missing ({path}); install from a clone of the "
                              "repository with `pip install -e .`, or pass --model and --head")
    return DEFAULT_MODEL, DEFAULT_HEAD


def default_artifacts() -> Path | None:
    """The shipped ONNX graphs of the default model, where this install has them."""
    return DEFAULT_ARTIFACTS if (DEFAULT_ARTIFACTS / MANIFEST).is_file() else None


def auto_backend() -> str:
    """ONNX Runtime where it is installed (the edge path), else the torch reference."""
    return "onnxruntime" if importlib.util.find_spec("onnxruntime") is not None else "torch"


def resolve(model: Path | None, head: Path | None, artifacts: Path | None,
            backend: str | None) -> tuple[Path | None, Path | None, Path | None, str]:
    """(model, head, artifacts, backend) as the commands use them: with neither a model nor artifacts
    given, the embedded default, served from its shipped graphs on onnxruntime; an unset backend is
    onnxruntime where installed when there is something to speculate with, else the torch reference."""
    embedded = model is None and artifacts is None
    if embedded:
        model, default_head = default_model()
        head = head or default_head
    backend = backend or (auto_backend() if head or artifacts else "torch")
    if embedded and backend == "onnxruntime" and head == DEFAULT_HEAD:
        artifacts = default_artifacts()
    return model, head, artifacts, backend
