"""Load and check an artifacts directory's manifest.json before any graph is opened.

A graph runtime trusts the manifest for every size it allocates and every token id it compares, so
a stale, foreign or incomplete export must fail here, in one line that says how to fix it, rather
than as a shape error deep inside ONNX Runtime or TensorRT.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .errors import GlanceError
from .graphs import DRAFT_GRAPH, MANIFEST, TARGET_GRAPH, VISION_GRAPH, VOCAB_GRAPH
from .integrity import file_digest, sha256, verify_files  # noqa: F401 (sha256: callers hash through here)

FORMAT = "glance-onnx"
FORMAT_VERSION = 2
REEXPORT = "re-export with `glance-export onnx`"


@dataclass(frozen=True)
class Stack:
    """KV geometry of a layer stack (the target's or the head's)."""

    num_layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Manifest:
    path: Path
    toolkit_version: str
    family: str
    is_vl: bool
    float_dtype: str  # numpy name of the graphs' float inputs/outputs
    hidden_size: int
    tap_width: int  # n_taps * hidden: a row of the target's `taps`, the draft's `context_taps`
    target: Stack
    head: Stack
    deepstack_layers: int
    block_size: int
    branch_k: int
    mask_token_id: int
    image_token_id: int | None
    stop_token_ids: tuple[int, ...]
    max_tree: int
    max_context: int
    spatial_merge_size: int | None
    vision_index_params: dict[str, Any] | None
    source: dict[str, Any]


def _version(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in str(text).split(".")[:2])
    except ValueError:
        raise GlanceError(f"manifest toolkit_version {text!r} is not a version; {REEXPORT}") from None
    return major, minor


def check_version(exported: str, runtime: str = __version__) -> None:
    """Same major version (same minor while 0.x), and never an export newer than this runtime."""
    e, r = _version(exported), _version(runtime)
    same_series = e[0] == r[0] and (e[0] > 0 or e[1] == r[1])
    if not same_series or e > r:
        raise GlanceError(f"artifacts were exported by toolkit {exported} but this runtime is {runtime}; "
                          f"{REEXPORT} {runtime} (or install toolkit {exported})")


def _stack(entry: dict[str, Any]) -> Stack:
    return Stack(int(entry["num_layers"]), int(entry["num_kv_heads"]), int(entry["head_dim"]))


def load_manifest(artifacts_dir: str | Path) -> Manifest:
    """Parse, version-check and completeness-check `artifacts_dir/manifest.json`."""
    path = Path(artifacts_dir)
    file = path / MANIFEST
    if not path.is_dir():
        raise GlanceError(f"artifacts directory {path} does not exist; create it with `glance-export onnx`")
    if not file.is_file():
        raise GlanceError(f"{path} has no {MANIFEST}; {REEXPORT}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise GlanceError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}); {REEXPORT}") from None
    if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise GlanceError(f"{file} is format {raw.get('format')!r} v{raw.get('format_version')}, this runtime reads "
                          f"{FORMAT!r} v{FORMAT_VERSION}; {REEXPORT}")
    check_version(raw.get("toolkit_version", "?"))
    try:
        graphs = raw["graphs"]
        is_vl = bool(raw["is_vl"])
        needed = {"target": TARGET_GRAPH, "draft": DRAFT_GRAPH, "vocab": VOCAB_GRAPH,
                  **({"vision": VISION_GRAPH} if is_vl else {})}
        for key, name in needed.items():
            if key not in graphs or not (path / name).is_file():
                raise GlanceError(f"{path} lacks the {key} graph ({name}); {REEXPORT}")
            data = graphs[key].get("data_file")
            if data and not (path / data).is_file():
                raise GlanceError(f"{path} lacks {data}, the weights of {name}; copy the whole directory or {REEXPORT}")
        for name in raw.get("files", []):
            if not (path / name).is_file():
                raise GlanceError(f"{path} lacks {name}, listed in its manifest; copy the whole directory or {REEXPORT}")
        _check_hashes(path, raw, needed)
        target, vision = graphs["target"], graphs.get("vision") or {}
        return Manifest(
            path=path, toolkit_version=raw["toolkit_version"], family=raw["family"], is_vl=is_vl,
            float_dtype=raw["float_io_dtype"], hidden_size=int(target["hidden_size"]), target=_stack(target),
            tap_width=int(graphs["draft"]["context_width"]),
            head=_stack(graphs["draft"]), deepstack_layers=int(target.get("deepstack_layers") or 0), block_size=int(raw["block_size"]),
            branch_k=int(raw["branch_k"]), mask_token_id=int(raw["mask_token_id"]),
            image_token_id=raw.get("image_token_id"), stop_token_ids=tuple(int(i) for i in raw["stop_token_ids"]),
            max_tree=int(raw["limits"]["max_tree"]), max_context=int(raw["limits"]["max_context"]),
            spatial_merge_size=(raw.get("rope") or {}).get("spatial_merge_size"),
            vision_index_params=vision.get("index_params"), source=raw.get("source") or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise GlanceError(f"{file} is incomplete or malformed ({type(exc).__name__}: {exc}); {REEXPORT}") from None


def _check_hashes(path: Path, raw: dict[str, Any], needed: dict[str, str]) -> None:
    """Every file the export recorded (graphs, weights, tokenizer and processor files, any others) against its
    sha256 and size; the files the runtime reads must all be among them."""
    hashes = raw.get("file_hashes")
    if not isinstance(hashes, dict):
        raise GlanceError(f"{path / MANIFEST} records no file hashes (an export from before they were checked); "
                          f"{REEXPORT}")
    graphs = raw["graphs"]
    names = [*needed.values(), *(graphs[k].get("data_file") for k in needed), *raw.get("files", [])]
    unrecorded = [n for n in names if n and n not in hashes]
    if unrecorded:
        raise GlanceError(f"{path / MANIFEST} records no hash for {unrecorded[0]}; {REEXPORT}")
    verify_files(path, hashes, f"copy the directory again or {REEXPORT}")


def check_source(manifest: Manifest, model_dir: str | Path) -> None:
    """Refuse to compare artifacts against a model directory other than the one they were exported from."""
    model = Path(model_dir)
    expected = manifest.source.get("weights_sha256") or {}
    config_sha = manifest.source.get("config_sha256")
    if config_sha and (not (model / "config.json").is_file() or file_digest(model / "config.json") != config_sha):
        raise GlanceError(f"{model}/config.json differs from the one {manifest.path} was exported from; "
                          f"pass the original model directory or {REEXPORT}")
    for name, sha in expected.items():
        if not (model / name).is_file() or file_digest(model / name) != sha:
            raise GlanceError(f"{model}/{name} differs from the weights {manifest.path} was exported from; "
                              f"pass the original model directory or {REEXPORT}")
