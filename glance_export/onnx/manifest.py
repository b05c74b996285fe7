"""The artifacts manifest's content, gathered from an export: the snapshot, the head, the graphs written.

Its schema, version, content hash and the one writer are `glance_runtime.formats.artifacts`.
"""
from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import onnx

from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import LEGACY_WEIGHTS_FILE, Eagle3Head
from glance_export.model.head import WEIGHTS_FILE, DraftHead
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime._version import __version__
from glance_runtime.errors import GlanceError
from glance_runtime.store.integrity import record, sha256

from .external_data import graph_tensors
from .spec import Dims
from .vision import INDEX_INPUTS

RUNTIME_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "video_preprocessor_config.json", "generation_config.json", "special_tokens_map.json", "config.json")


def copy_runtime_files(snapshot: Snapshot, out: Path) -> list[str]:
    """Tokenizer, chat template, processor and generation configs (and config.json for the rope index).

    tokenizer.json is written as transformers loads it, not copied: for some classes (qwen2) transformers
    replaces the file's pre-tokenizer, and a runtime reading the raw file would tokenize differently."""
    copied = []
    for name in RUNTIME_FILES:
        backend = getattr(snapshot.tokenizer, "backend_tokenizer", None) if name == "tokenizer.json" else None
        if backend is not None:
            backend.save(str(out / name))
        elif (snapshot.path / name).is_file():
            shutil.copy2(snapshot.path / name, out / name)
        else:
            continue
        copied.append(name)
    return copied


def io_spec(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Inputs and outputs of a graph file as {name: {dtype, shape}}, symbolic axes by name."""
    graph = onnx.load(str(path), load_external_data=False).graph

    def describe(values) -> dict[str, dict[str, Any]]:
        out = {}
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_param or d.dim_value for d in t.shape.dim]
            out[v.name] = {"dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": shape}
        return out

    return {"inputs": describe(graph.input), "outputs": describe(graph.output)}


def data_file(path: Path) -> str | None:
    """The one external data file a graph reads its weights from , if any."""
    graph = onnx.load(str(path), load_external_data=False).graph
    files = {e.value for t in graph_tensors(graph) for e in t.external_data if e.key == "location"}
    if len(files) > 1:
        raise GlanceError(f"{path.name} reads weights from {len(files)} data files; one is written per graph")
    return next(iter(files), None)


def source_hashes(snapshot_dir: Path) -> dict[str, str]:
    """The snapshot's weight files by name and sha256 (the manifest's `source.weights_sha256`)."""
    return {p.name: sha256(p) for p in sorted(Path(snapshot_dir).glob("*.safetensors"))}


class SourceHashes:
    """`source_hashes` taken in a thread beside the export (hashlib and file reads release the GIL), a daemon
    one, so an export that fails does not wait for it."""

    def __init__(self, snapshot_dir: Path) -> None:
        self._hashes: dict[str, str] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(snapshot_dir,), name="source-hashes", daemon=True)
        self._thread.start()

    def _run(self, snapshot_dir: Path) -> None:
        try:
            self._hashes = source_hashes(snapshot_dir)
        except BaseException as exc:  # raised where the hashes are wanted
            self._error = exc

    def result(self) -> dict[str, str]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hashes


def _eagle3_fields(head: Eagle3Head, dims: Dims) -> dict[str, Any]:
    """What a runtime needs to drive an EAGLE-3 draft graph besides its KV geometry."""
    return {"kind": "eagle3", "max_depth": EAGLE3_DEPTH, "mrope": dims.head_mrope, "tap_layer_ids": list(dims.tap_ids),
            "hidden_size": head.config.hidden_size, "draft_vocab_size": head.config.draft_vocab_size}


def _weights_file(head_dir: Path) -> Path:
    """The head's weights as written (an EAGLE-3 head may still carry the older pytorch_model.bin)."""
    legacy = head_dir / LEGACY_WEIGHTS_FILE
    return legacy if not (head_dir / WEIGHTS_FILE).is_file() and legacy.is_file() else head_dir / WEIGHTS_FILE


def build_manifest(snapshot: Snapshot, head: DraftHead | Eagle3Head, head_dir: Path, dims: Dims, out: Path, *, dtype: str,
                   opset: int, branch_k: int, max_tree: int, max_context: int, axes: dict[str, list[int]],
                   files: list[str], quantization: dict[str, Any] | None = None,
                   weights_sha256: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest's fields (all but the header and content hash `formats.artifacts.write` adds);
    `weights_sha256`: `source_hashes` of the snapshot when taken already (None: taken now)."""
    tc = snapshot.text_config
    graphs: dict[str, Any] = {
        "target": {"num_layers": dims.layers, "num_kv_heads": dims.kv_heads, "head_dim": dims.head_dim,
                   "hidden_size": dims.hidden, "vocab_size": dims.vocab, "tap_layer_ids": list(dims.tap_ids),
                   "position_axes": dims.position_axes, "deepstack_layers": dims.deepstack},
        "draft": {"num_layers": dims.head_layers, "num_kv_heads": dims.head_kv_heads,
                  "head_dim": dims.head_head_dim, "context_width": dims.n_taps * dims.hidden,
                  **(_eagle3_fields(head, dims) if dims.head_kind == "eagle3" else {})},
        "vocab": {"vocab_size": dims.vocab, "hidden_size": dims.hidden, "tied": dims.tied, "branch_k": branch_k},
    }
    if dims.draft_vocab:
        graphs["draft_vocab"] = {"vocab_size": dims.draft_vocab, "hidden_size": dims.hidden, "tied": dims.tied,
                                 "branch_k": branch_k}
    if dims.is_vl:
        graphs["vision"] = {"index_params": {k: dims.vision[k] for k in
                                             ("family", "merge_size", "patch_size", "window_size", "grid_per_side")},
                            "index_inputs": INDEX_INPUTS[dims.family], "patch_dim": dims.vision["patch_dim"]}
    for name, entry in graphs.items():
        path = out / f"{name}.onnx"
        entry.update(file=path.name, data_file=data_file(path), **io_spec(path))
    written = list(dict.fromkeys(n for entry in graphs.values() for n in (entry["file"], entry["data_file"]) if n))
    written += files
    written += [n for entry in (quantization or {}).get("graphs", {}).values()
                for n in (entry["tensorrt_file"], entry["tensorrt_data_file"]) if n]
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    return {
        "toolkit_version": __version__,
        "family": dims.family, "is_vl": dims.is_vl, "dtype": dtype, "opset": opset,
        "float_io_dtype": "float16" if dtype == "fp16" else "float32",
        "fp32_outputs": ["topk_logprobs", "entropy", "logits"],
        "branch_k": branch_k, "block_size": dims.block_size, "mask_token_id": dims.mask_token_id,
        "image_token_id": dims.image_token_id, "stop_token_ids": list(snapshot.stop_token_ids),
        "limits": {"max_tree": max_tree, "max_context": max_context, "max_batch": dims.max_batch}, "axes": axes,
        "rope": {"theta": rope.get("rope_theta", tc.get("rope_theta")), "mrope_section": rope.get("mrope_section"),
                 "vision_start_token_id": snapshot.config.get("vision_start_token_id"),
                 "spatial_merge_size": dims.vision["merge_size"] if dims.is_vl else None},
        "source": {"config_sha256": sha256(snapshot.path / "config.json"),
                   "weights_sha256": source_hashes(snapshot.path) if weights_sha256 is None else weights_sha256},
        "head_kind": dims.head_kind,
        "head": {"config": head.config.to_json(), "weights_sha256": sha256(_weights_file(Path(head_dir)))},
        "graphs": graphs, "files": files, "quantization": quantization, "file_hashes": record(out, written),
    }
