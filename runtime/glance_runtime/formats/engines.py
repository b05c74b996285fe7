"""engines.json of an engines directory (`glance-export build`): what the engines were built with and from.

A TensorRT plan runs only on the TensorRT version and GPU it was built for, so the record names both;
its limits bound every pass, its precision is what audits gate on, and it points at the artifacts the
engines were built from. `content_sha256` covers every field (an edited record is refused as edited);
the fields the runtime reads are type- and range-checked; each engine file is listed with its size and
sha256 (checked by `integrity.verify_engines` before any is deserialized).

Document (format_version 4): format, format_version, toolkit_version, target, tensorrt {module, version},
device {name, compute_capability | runs_on_compute_capabilities, memory_gib}, precision {name,
artifacts_dtype, how}, limits {max_context, max_tree, max_image_tokens, max_batch (the sequences a target or draft
pass serves: the engines' batch axis and KV pool slots)}, memory_plan, timing_cache,
artifacts {path, manifest_sha256, toolkit_version, family, dtype, opset, limits, source,
head_weights_sha256}, engines {graph: {file, bytes, sha256, onnx, build_s, profiles} | {parts: [{file,
bytes, sha256, inputs, outputs, weight_bytes, build_s, peak_rss_gib}], onnx, build_s, profiles}}, build_s,
target_profile, content_sha256. Version 2 added content_sha256; version 3 lets a graph be an ordered list
of parts, engines run one after the other (`graph_chain`), each naming the tensors it reads and writes;
version 4 holds one engine per graph kind, the target and draft engines taking a batch axis over the KV pool
with a batch profile beside a lone sequence's (version 3's target and draft engines read a past of their own,
and batched rounds had engines of their own with the weights again). Engines of an older version are refused
by the version header, naming the rebuild.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..store.atomic import write_file
from ..store.input_files import present
from ..errors import GlanceError
from .common import (MAX_BATCH, Invalid, check_header, check_int, check_text, digest, dumps, guarded, integer, obj,
                     optional_text, read_json, stamped)

FORMAT = "glance-engines"
VERSION = 4
FILE = "engines.json"
WHAT = "GLANCE engine manifest"
HASH_FIELD = "content_sha256"
REBUILD = "rebuild with `glance-export build`"
BIG = 1 << 24


@dataclass(frozen=True)
class EngineFile:
    file: str
    bytes: int
    sha256: str
    inputs: tuple[str, ...] = ()  # a part's: the tensors it reads (the pass's and earlier parts')
    outputs: tuple[str, ...] = ()  # ... and writes (the pass's and what later parts read)


@dataclass(frozen=True)
class EnginesRecord:
    path: Path  # the engines directory
    module: str  # tensorrt or tensorrt_rtx
    tensorrt_version: str
    compute_capabilities: tuple[str, ...]  # the one built on, or every one an ahead-of-time build runs on
    precision: str | None
    max_context: int
    max_tree: int
    artifacts_path: str | None
    artifacts_manifest_sha256: str | None
    engines: dict[str, tuple[EngineFile, ...]]  # graph -> its one engine, or its parts in run order
    raw: dict[str, Any]
    max_batch: int = 1  # sequences a target or draft engine's pass serves at most (limits.max_batch)

    @property
    def files(self) -> tuple[EngineFile, ...]:
        """Every engine file, each part of a chained graph included."""
        return tuple(f for parts in self.engines.values() for f in parts)


def _names(entry: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    names = entry.get(key)
    if not isinstance(names, list) or not names:
        raise Invalid(f"{where}{key} must be a non-empty list of tensor names")
    return tuple(check_text(name, f"{where}{key}[]") for name in names)


def _file(entry: Any, where: str, part: bool) -> EngineFile:
    if not isinstance(entry, dict):
        raise Invalid(f"{where.rstrip('.')} must be an object")
    name = check_text(entry.get("file"), f"{where}file")
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
        raise Invalid(f"{where}file is {name!r}; it must name a file in the engines directory")
    io = (_names(entry, "inputs", where), _names(entry, "outputs", where)) if part else ((), ())
    return EngineFile(name, integer(entry, "bytes", 0, 1 << 50, where), check_text(entry.get("sha256"), f"{where}sha256"),
                      *io)


def _engine(graph: str, entry: Any) -> tuple[EngineFile, ...]:
    """A graph's one engine, or its parts in run order: each part reads only the graph's inputs and what an
    earlier part writes."""
    where = f"engines.{graph if graph.isprintable() else repr(graph)}."  # a graph name is a key: any text
    if not isinstance(entry, dict) or "parts" not in entry:
        return (_file(entry, where, part=False),)
    parts = entry["parts"]
    if not isinstance(parts, list) or not parts:
        raise Invalid(f"{where}parts must be a non-empty list")
    files = tuple(_file(part, f"{where}parts[{i}].", part=True) for i, part in enumerate(parts))
    if len({f.file for f in files}) != len(files):
        raise Invalid(f"{where}parts name one file twice")
    return files


def _parse(path: Path, raw: dict[str, Any]) -> EnginesRecord:
    tensorrt, limits = obj(raw, "tensorrt"), obj(raw, "limits")
    device = raw.get("device") or {}
    if not isinstance(device, dict):
        raise Invalid("device must be an object")
    built = optional_text(device, "compute_capability", "device.")
    runs_on = device.get("runs_on_compute_capabilities") or []
    if not isinstance(runs_on, list):
        raise Invalid("device.runs_on_compute_capabilities must be a list")
    capabilities = (built,) if built else tuple(check_text(c, "device.runs_on_compute_capabilities[]") for c in runs_on)
    precision = raw.get("precision") or {}
    artifacts = raw.get("artifacts") or {}
    if not isinstance(precision, dict) or not isinstance(artifacts, dict):
        raise Invalid("precision and artifacts must be objects")
    engines = obj(raw, "engines")
    if not engines:
        raise Invalid("engines lists no engine")
    max_context = integer(limits, "max_context", 2, BIG, "limits.")
    return EnginesRecord(
        path=path.parent, module=check_text(tensorrt.get("module"), "tensorrt.module", ("tensorrt", "tensorrt_rtx")),
        tensorrt_version=check_text(tensorrt.get("version"), "tensorrt.version"), compute_capabilities=capabilities,
        precision=optional_text(precision, "name", "precision."), max_context=max_context,
        max_tree=check_int(limits.get("max_tree"), "limits.max_tree", 1, max_context - 1),
        artifacts_path=optional_text(artifacts, "path", "artifacts."),
        artifacts_manifest_sha256=optional_text(artifacts, "manifest_sha256", "artifacts."),
        engines={graph: _engine(graph, entry) for graph, entry in engines.items()}, raw=raw,
        max_batch=integer(limits, "max_batch", 1, MAX_BATCH, "limits."))


def read(engines_dir: str | Path) -> EnginesRecord:
    """Parse and check `engines_dir/engines.json` (not the engine files: `integrity.verify_engines`)."""
    engines_dir = Path(engines_dir)
    file = engines_dir / FILE
    if not engines_dir.is_dir():
        what = "is not a directory" if engines_dir.exists() else "does not exist"
        raise GlanceError(f"engines directory {engines_dir} {what}; build it with `glance-export build`")
    if not present(file, WHAT, REBUILD):
        raise GlanceError(f"{engines_dir} has no {FILE}; build it with `glance-export build`")
    raw = read_json(file, WHAT, REBUILD)
    check_header(raw, file, WHAT, FORMAT, VERSION, REBUILD)
    if raw.get(HASH_FIELD) != digest(raw, leave_out=HASH_FIELD):
        raise GlanceError(f"{file} was edited after the build (its fields no longer match the content_sha256 it "
                          f"records); copy the engines directory again or {REBUILD}")
    return guarded(file, REBUILD, lambda: _parse(file, raw))


def write(engines_dir: str | Path, document: dict[str, Any]) -> Path:
    """Write engines.json (whole or not at all) with its header and content hash."""
    file = Path(engines_dir) / FILE
    write_file(file, dumps(stamped(document, FORMAT, VERSION, HASH_FIELD), indent=2))
    return file
