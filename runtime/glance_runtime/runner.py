"""Opens a backend with everything a caller needs around it: prompt building, stop ids, detokenizing.

Backends are imported only when chosen, and the torch reference comes through the one lazy door
to the exporter side (`exporter`), so the ONNX Runtime path never imports torch.
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from . import __version__, exporter
from .backend import Backend
from .cache import cache_root, file_lock
from .defaults import DEFAULT_ARTIFACTS
from .errors import GlanceError
from .limits import Limits
from .formats.artifacts import VERSION as FORMAT_VERSION, read as load_manifest

BACKENDS = ("torch", "onnxruntime", "tensorrt")


@dataclass
class Runner:
    backend: Backend
    build_prompt: Callable[[str, str | Path | None], Any]
    stop_ids: tuple[int, ...]
    detokenize: Callable[[Sequence[int]], str]
    limits: Limits
    oracle: Callable[[Any, int], list[int]] | None = None  # independent greedy decode, when the backend has one
    home: Path | None = None  # the artifacts or engines served: a cost profile is stored beside them
    identity: str = ""  # what is served, for cache keys where there is no `home` (the torch reference)
    calibration_dirs: tuple[Path, ...] = ()  # where `calibration.json` for `--budget auto` may be, first first


def _graph_runner(backend, model: Path | None) -> Runner:
    """A graph backend with, when `model` (the snapshot its graphs came from) is given, the torch oracle,
    loaded on first use only, so plain runs never import torch."""
    reference: list[Runner] = []

    def oracle(prompt, max_new_tokens: int) -> list[int]:
        if not reference:
            from .formats.artifacts import check_source

            check_source(backend.manifest, model)
            reference.append(exporter.torch_runner(model, None))
        return reference[0].oracle(prompt, max_new_tokens)

    limits = Limits(backend.block_size, backend.manifest.branch_k, backend.max_tree, exported=True)
    places = tuple(dict.fromkeys([backend.path, backend.manifest.path]))  # engines first, then their artifacts
    shipped = Path(backend.path).resolve() == DEFAULT_ARTIFACTS.resolve()  # part of the install: kept unwritten
    return Runner(backend=backend, build_prompt=backend.build_prompt, stop_ids=tuple(backend.stop_token_ids),
                  detokenize=backend.detokenize, limits=limits, oracle=oracle if model is not None else None,
                  home=None if shipped else backend.path, identity=str(Path(backend.path).resolve()),
                  calibration_dirs=places)


def open_onnxruntime(artifacts: Path, model: Path | None = None, **options) -> Runner:
    """ORT on exported graphs (options: providers, max_context, max_tree, threads)."""
    from .backends.ort_backend import OrtBackend

    return _graph_runner(OrtBackend(artifacts, **options), model)


def open_tensorrt(engines: Path, artifacts: Path | None = None, model: Path | None = None, **options) -> Runner:
    """TensorRT engines from `glance-export build` (options: max_context, max_tree)."""
    from .backends.trt_backend import TrtBackend

    return _graph_runner(TrtBackend(engines, artifacts, **options), model)


def exported_artifacts(model: Path, head: Path, progress: Callable[[str], None]) -> Path:
    """Artifacts for (model, head) in the cache, exported on first use.

    Keyed by file names, sizes and modification times (cheap even for multi-GB weights), the
    toolkit version and the artifacts format; the manifest's own hashes still guard against a mismatched directory.
    A lock file beside the entry makes concurrent first uses export once (the others wait, then reuse it),
    and an entry that fails its manifest's checks (a damaged or half-deleted one) is exported again."""
    key = hashlib.sha256(f"{__version__}:{FORMAT_VERSION}".encode())
    for root in (Path(model), Path(head)):
        if not root.is_dir():
            raise GlanceError(f"{root} does not exist")
        for f in sorted(p for p in root.iterdir() if p.is_file()):
            stat = f.stat()
            key.update(f"{f.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = cache_root() / "onnx" / key.hexdigest()[:20]
    with file_lock(out.with_name(f"{out.name}.lock")):
        if out.exists():
            try:
                load_manifest(out)
                return out
            except GlanceError as exc:
                progress(f"cached export {out} is unusable ({exc}); exporting it again")
                shutil.rmtree(out)
        return exporter.export(model, head, out, progress)


def open_runner(backend: str, *, model: Path | None = None, head: Path | None = None,
                artifacts: Path | None = None, engines: Path | None = None, dtype: str = "float32",
                progress: Callable[[str], None] = lambda _: None, **ort_options) -> Runner:
    """`ort_options`: providers, max_context, max_tree, threads (onnxruntime; max_* for tensorrt too)."""
    if backend == "torch":
        if model is None:
            raise GlanceError("the torch backend needs --model (a HF snapshot directory)")
        return exporter.torch_runner(model, head, dtype)
    if backend == "onnxruntime":
        if artifacts is None:
            if model is None or head is None:
                raise GlanceError("the onnxruntime backend needs --artifacts DIR (from `glance-export onnx`), "
                                  "or --model and --head to export them once into the cache")
            artifacts = exported_artifacts(model, head, progress)
        return open_onnxruntime(artifacts, model, **ort_options)
    if backend == "tensorrt":
        if engines is None:
            raise GlanceError("the tensorrt backend needs --engines DIR (from `glance-export build`)")
        limits = {k: v for k, v in ort_options.items() if k in ("max_context", "max_tree")}
        return open_tensorrt(engines, artifacts, model, **limits)
    raise GlanceError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
