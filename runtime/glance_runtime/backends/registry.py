"""Opens a backend with everything a caller needs around it: prompt building, stop ids, detokenizing.

Backends are imported only when chosen, and the torch reference is the one the export package
registers (`extensions`), so the ONNX Runtime path never imports torch.
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import __version__
from . import extensions
from ..decode.backend import Backend, ServeLimits
from ..store.cache import cache_root, file_lock
from ..defaults import DEFAULT_ARTIFACTS
from ..errors import GlanceError, IntegrityError
from ..formats.artifacts import VERSION as FORMAT_VERSION, Manifest, check_source, read as load_manifest

BACKENDS = ("torch", "onnxruntime", "tensorrt")


@dataclass(frozen=True)
class Conversations:
    """What whole conversations need of a runner beyond one prompt: building a message list (several turns and
    images), the raw `tokenizers.Tokenizer` (streamed text), the image-token rules (which rows a later turn can
    reuse) and the context rows the backend holds."""
    build: Callable[[list[dict[str, Any]]], Any]
    tokenizer: Any
    image_token_id: int | None  # None for text-only targets
    merge_size: int
    max_context: int


@dataclass
class Runner:
    backend: Backend
    build_prompt: Callable[[str, str | Path | None], Any]
    stop_ids: tuple[int, ...]
    detokenize: Callable[[Sequence[int]], str]
    conversations: Conversations
    oracle: Callable[[Any, int], list[int]] | None = None  # independent greedy decode, when the backend has one
    home: Path | None = None  # the artifacts or engines served: a cost profile is stored beside them
    identity: str = ""  # what is served, for cache keys where there is no `home` (the torch reference)
    calibration_dirs: tuple[Path, ...] = ()  # where `calibration.json` for `--budget auto` may be, first first

    @property
    def limits(self) -> ServeLimits:
        return self.backend.info.limits


class _TorchOracle:
    """The torch reference's greedy decode of `model`, the snapshot exported graphs came from: loaded on
    first use only (so plain runs never import torch), after checking the graphs were exported from it."""

    def __init__(self, manifest: Manifest, model: Path):
        self.manifest, self.model = manifest, model
        self._reference: Runner | None = None

    def __call__(self, prompt, max_new_tokens: int) -> list[int]:
        if self._reference is None:
            check_source(self.manifest, self.model)
            self._reference = extensions.torch_runner(self.model, None)
        return self._reference.oracle(prompt, max_new_tokens)


def _graph_runner(backend, model: Path | None) -> Runner:
    """A graph backend with, when `model` (the snapshot its graphs came from) is given, the torch oracle."""
    info = backend.info
    places = tuple(dict.fromkeys([info.home, info.manifest.path]))  # engines first, then their artifacts
    shipped = Path(info.home).resolve() == DEFAULT_ARTIFACTS.resolve()  # part of the install: kept unwritten
    m = info.manifest
    conversations = Conversations(backend.prompts.build_messages, backend.prompts.tokenizer,
                                  m.image_token_id if m.is_vl else None, m.spatial_merge_size if m.is_vl else 1,
                                  backend.max_context)
    return Runner(backend=backend, build_prompt=backend.build_prompt, stop_ids=tuple(backend.stop_token_ids),
                  detokenize=backend.detokenize, conversations=conversations,
                  oracle=_TorchOracle(info.manifest, model) if model is not None else None,
                  home=None if shipped else info.home, identity=str(Path(info.home).resolve()),
                  calibration_dirs=places)


def open_onnxruntime(artifacts: Path, model: Path | None = None, **options) -> Runner:
    """ORT on exported graphs (options: providers, max_context, max_tree, threads)."""
    from .ort_backend import OrtBackend

    return _graph_runner(OrtBackend(artifacts, **options), model)


def open_tensorrt(engines: Path, artifacts: Path | None = None, model: Path | None = None, **options) -> Runner:
    """TensorRT engines from `glance-export build` (options: max_context, max_tree)."""
    from .trt_backend import TrtBackend

    return _graph_runner(TrtBackend(engines, artifacts, **options), model)


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


def exported_artifacts(model: Path, head: Path, progress: Callable[[str], None]) -> Path:
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


def open_runner(backend: str, *, model: Path | None = None, head: Path | None = None,
                artifacts: Path | None = None, engines: Path | None = None, dtype: str = "float32",
                providers: Sequence[str] | str | None = None, threads: int | None = None,
                max_context: int | None = None, max_tree: int | None = None,
                progress: Callable[[str], None] = lambda _: None) -> Runner:
    """`providers` and `threads` apply to onnxruntime, `max_context` and `max_tree` to both graph backends;
    the torch reference has none of these bounds."""
    if backend == "torch":
        if model is None:
            raise GlanceError("the torch backend needs --model (a HF snapshot directory)")
        return extensions.torch_runner(model, head, dtype)
    if backend == "onnxruntime":
        if artifacts is None:
            if model is None or head is None:
                raise GlanceError("the onnxruntime backend needs --artifacts DIR (from `glance-export onnx`), "
                                  "or --model and --head to export them once into the cache")
            artifacts = exported_artifacts(model, head, progress)
        return open_onnxruntime(artifacts, model, providers=providers, threads=threads, max_context=max_context,
                                max_tree=max_tree)
    if backend == "tensorrt":
        if engines is None:
            raise GlanceError("the tensorrt backend needs --engines DIR (from `glance-export build`)")
        return open_tensorrt(engines, artifacts, model, max_context=max_context, max_tree=max_tree)
    raise GlanceError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
