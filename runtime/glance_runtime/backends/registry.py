"""Backends by name: each opener turns a `Source` (what the shared flags name) into a Session, the backend
with its prompt codec, oracle and where its cost profile and calibration live.

Backends are imported only when chosen, and the torch reference is the one the export package
registers (`extensions`), so the ONNX Runtime path never imports torch.
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .._version import __version__
from . import extensions
from ..decode.session import Session, Settings
from ..decode.loop import DecodeConfig
from ..defaults import DEFAULT_ARTIFACTS
from ..errors import GlanceError, IntegrityError
from ..formats.artifacts import VERSION as FORMAT_VERSION, Manifest, check_source, read as load_manifest
from ..prompt.codec import exported_codec
from ..prompt.prompt_builder import Prompt
from ..store.cache import cache_root, file_lock

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Source:
    """Which model, on which backend: what the shared command-line flags name (`flags.runner_flags`)."""
    backend: str
    model: Path | None = None
    head: Path | None = None
    artifacts: Path | None = None
    engines: Path | None = None
    providers: Sequence[str] | None = None  # ONNX Runtime execution providers, in priority order
    threads: int | None = None  # ONNX Runtime intra-op threads
    max_context: int | None = None  # below the export's or build's bound (graph backends)
    max_tree: int | None = None
    max_batch: int = 1  # sequences decoded together (graph backends: a KV pool and the batched graphs)


class _TorchOracle:
    """The torch reference's greedy decode of `model`, the snapshot exported graphs came from: loaded on
    first use only (so plain runs never import torch), after checking the graphs were exported from it."""

    def __init__(self, manifest: Manifest, model: Path):
        self.manifest, self.model = manifest, model
        self._reference: Session | None = None

    def __call__(self, prompt: Prompt, max_new_tokens: int) -> list[int]:
        if self._reference is None:
            check_source(self.manifest, self.model)
            self._reference = extensions.torch_session(self.model, None)
        return self._reference.oracle(prompt, max_new_tokens)


def _graph_session(backend, model: Path | None, settings: Settings | DecodeConfig, progress: Progress) -> Session:
    """A graph backend with its exported codec and, when `model` (the snapshot its graphs came from) is given,
    the torch oracle."""
    info = backend.info
    if backend.max_batch > 1:
        progress(f"loaded for {backend.max_batch} requests at once: {backend.memory_line()}")
    places = tuple(dict.fromkeys([info.home, info.manifest.path]))  # engines first, then their artifacts
    shipped = Path(info.home).resolve() == DEFAULT_ARTIFACTS.resolve()  # part of the install: kept unwritten
    return Session(backend, exported_codec(info.manifest), settings, progress,
                   oracle=_TorchOracle(info.manifest, model) if model is not None else None,
                   home=None if shipped else info.home, identity=str(Path(info.home).resolve()),
                   calibration_dirs=places)


def export_cache_entry(model: Path, head: Path) -> Path:
    """Where the cache keeps the export of (model, head): keyed by file names, sizes and modification times
    (cheap even for multi-GB weights), the toolkit version and the artifacts format."""
    key = hashlib.sha256(f"{__version__}:{FORMAT_VERSION}".encode())
    for root in (Path(model), Path(head)):
        if not root.is_dir():
            raise GlanceError(f"{root} does not exist")
        for f in sorted(p for p in root.iterdir() if p.is_file()):
            stat = f.stat()
            key.update(f"{f.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_root() / "onnx" / key.hexdigest()[:20]


def exported_artifacts(model: Path, head: Path, progress: Progress) -> Path:
    """Artifacts for (model, head) in the cache, exported on first use.

    The manifest's own hashes guard against a mismatched directory. A lock file beside the entry makes
    concurrent first uses export once (the others wait, then reuse it), and an entry that fails its
    manifest's checks (a damaged or half-deleted one) is exported again."""
    out = export_cache_entry(model, head)
    with file_lock(out.with_name(f"{out.name}.lock")):
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            raise IntegrityError(f"cache entry {out} is not a directory (an export is one); remove it and run "
                                 "again to export afresh")
        if out.exists():
            try:
                load_manifest(out)
                return out
            except GlanceError as exc:
                progress(f"cached export {out} is unusable ({exc}); exporting it again")
                shutil.rmtree(out)
        return extensions.export(model, head, out, progress)


def _open_torch(source: Source, settings: Settings | DecodeConfig, progress: Progress) -> Session:
    """The torch reference (the export package's), on a snapshot; it has none of the graph backends' bounds."""
    if source.max_batch > 1:
        raise GlanceError("the torch reference decodes one request at a time; use --max-batch 1, or the "
                          "onnxruntime or tensorrt backend to batch")
    if source.model is None:
        raise GlanceError("the torch backend needs --model (a HF snapshot directory)")
    return extensions.torch_session(source.model, source.head, settings=settings, progress=progress)


def _open_onnxruntime(source: Source, settings: Settings | DecodeConfig, progress: Progress) -> Session:
    """ONNX Runtime on exported graphs (--artifacts, or --model and --head exported once into the cache)."""
    from .ort_backend import OrtBackend

    artifacts = source.artifacts
    if artifacts is None:
        if source.model is None or source.head is None:
            raise GlanceError("the onnxruntime backend needs --artifacts DIR (from `glance-export onnx`), "
                              "or --model and --head to export them once into the cache")
        artifacts = exported_artifacts(source.model, source.head, progress)
    backend = OrtBackend(artifacts, providers=source.providers, threads=source.threads,
                         max_context=source.max_context, max_tree=source.max_tree, max_batch=source.max_batch)
    return _graph_session(backend, source.model, settings, progress)


def _open_tensorrt(source: Source, settings: Settings | DecodeConfig, progress: Progress) -> Session:
    """TensorRT engines from `glance-export build`."""
    from .trt_backend import TrtBackend

    if source.engines is None:
        raise GlanceError("the tensorrt backend needs --engines DIR (from `glance-export build`)")
    backend = TrtBackend(source.engines, source.artifacts, max_context=source.max_context, max_tree=source.max_tree,
                         max_batch=source.max_batch)
    return _graph_session(backend, source.model, settings, progress)


OPENERS: dict[str, Callable[[Source, Settings | DecodeConfig, Progress], Session]] = {
    "torch": _open_torch, "onnxruntime": _open_onnxruntime, "tensorrt": _open_tensorrt}
BACKENDS = tuple(OPENERS)


def open_session(source: Source, settings: Settings | DecodeConfig = Settings(),
                 progress: Progress = lambda _: None) -> Session:
    """Open `source` and decode with `settings`: the one way in for commands and the Python API."""
    opener = OPENERS.get(source.backend)
    if opener is None:
        raise GlanceError(f"unknown backend {source.backend!r}; choose one of: {', '.join(BACKENDS)}")
    return opener(source, settings, progress)
