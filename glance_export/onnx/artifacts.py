"""`export_artifacts`: target + head -> a directory of validated ONNX graphs, manifest and tokenizer files.

Everything is written into a temporary sibling of the output directory and renamed into place only
after every graph has passed the checker and the ONNX Runtime validation, so a failed export never
leaves a half-written artifacts directory behind.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from glance_runtime.store.atomic import atomic_directory, check_output
from glance_runtime.decode.calibration import FILE as CALIBRATION
from glance_runtime.errors import GlanceError
from glance_runtime.backends.hardware import available_host_bytes
from glance_runtime.formats import artifacts as artifacts_format
from glance_runtime.formats.graphs import VOCABULARY_GRAPHS
from glance_export.model.vocab_choice import AUTO, head_for_export

from . import grouped_attention
from .allocator import return_freed_weights
from .batching import MAX_BATCH
from .depth_cut import CUT_LAYERS, FULL_VALIDATION_BYTES, validate_target
from .export import ATTENTION_OPSET, InMemory, export_graph, weight_bytes
from .feeds import trace_feeds
from .memory import GIB, check_fits, estimate_peak
from .manifest import SourceHashes, build_manifest, copy_runtime_files
from .quant_scheme import ACCURACY, group_size_line
from .quant_export import QuantizedGraph, export_quantized
from .quant_validate import validate_quantized
from .quantize import GRAPHS, OPTIONAL_GRAPHS, check_scheme, quantization_record, quantize_graphs
from .skeleton import Skeleton
from .sources import build_graphs, open_sources, target_skeleton
from .spec import DTYPES, axis_bounds, dims_for, dynamic_axes, output_shapes
from .stream import eta_reporter
from .validate import validate_graphs, validated, validation_feeds

OPSETS = (*range(14, 21), ATTENTION_OPSET)  # TensorRT 10.3 (Jetson Orin) parses up to 20; 23 needs 10.14+

ARTIFACTS_FORMAT = "glance-artifacts"
HEAD_GRAPHS = ("draft", "draft_vocab")  # weights held in memory (the head's), not streamed
QUANTIZED_GRAPHS = (*GRAPHS, *OPTIONAL_GRAPHS)


def _check_args(out: Path, inputs: tuple[Path, ...], dtype: str, opset: int, max_tree: int, max_context: int,
                branch_k: int, max_batch: int) -> None:
    if dtype not in DTYPES:
        raise GlanceError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if opset not in OPSETS:
        raise GlanceError(f"opset {opset} is not supported; use 14..20 (plain ops, TensorRT 10.3+) or "
                          f"{ATTENTION_OPSET} (ONNX Attention op, TensorRT 10.14+)")
    if max_tree < 1 or max_context <= max_tree:
        raise GlanceError(f"need 1 <= max_tree < max_context, got max_tree={max_tree}, max_context={max_context}; "
                          "lower --max-tree or raise --max-context")
    if branch_k < 1:
        raise GlanceError(f"branch_k must be at least 1, got {branch_k}; pass --branch-k 1 or more")
    if max_batch < 1:
        raise GlanceError(f"max_batch must be at least 1, got {max_batch}; pass --max-batch 1 or more")
    check_output(out, ARTIFACTS_FORMAT, inputs)


def _attention(opset: int) -> str:
    return "sdpa" if opset >= ATTENTION_OPSET else grouped_attention.NAME


def export_artifacts(model_dir: str | Path, head_dir: str | Path, out_dir: str | Path, *, dtype: str = "fp32",
                     opset: int = 17, max_tree: int = 64, max_context: int = 2048, branch_k: int = 8,
                     quantize: str | None = None, group_size: int | None = None, accuracy: str = ACCURACY,
                     max_batch: int = MAX_BATCH, draft_vocab: int | str = AUTO,
                     progress: Callable[[str], None] = print) -> Path:
    """Export vision (VL only), target, draft and vocab graphs, validate them, and write the manifest.

    `max_batch` bounds the sequences one pass of the target and draft graphs serves (their B axis; a lone
    sequence is a batch of one, and an EAGLE-3 head's export is bounded to 1).

    `draft_vocab`: the tokens a GLANCE head without a draft vocabulary of its own drafts over (`vocab_choice`):
    AUTO (a reduced one on a large vocabulary), ALL, or a size.

    `quantize` ("int8"/"int4"): the target, draft and vocabulary graphs are written weight-only quantized (see
    `quantize.py`), by `group_size` weights a scale (None: the largest supported size that divides the hidden
    size): straight from the trace (`quant_export.py`, validated by `quant_validate.py`), or at opset 23, whose
    exporter writes its own weights, as validated fp32 graphs rewritten afterwards."""
    out = Path(out_dir)
    return_freed_weights()
    _check_args(out, (Path(model_dir), Path(head_dir)), dtype, opset, max_tree, max_context, branch_k, max_batch)
    started = time.perf_counter()
    snapshot, checkpoint, head = open_sources(model_dir, head_dir, dtype)
    head, vocab_note = head_for_export(snapshot, head, draft_vocab)
    skeleton = target_skeleton(snapshot, checkpoint, dtype, _attention(opset))
    dims = dims_for(snapshot, head, max_batch)
    scheme = check_scheme(quantize, group_size, dims.hidden, dtype, accuracy) if quantize else None
    if scheme is not None and group_size is None:
        progress(group_size_line(scheme.group_size, dims.hidden))
    itemsize = 4 if dtype == "fp32" else 2
    estimate = estimate_peak(checkpoint, itemsize, weight_bytes(head), dims.layers, CUT_LAYERS, FULL_VALIDATION_BYTES,
                             quantize=scheme is not None)
    check_fits(estimate, dtype, available_host_bytes(), quantize=scheme is not None)
    graphs = build_graphs(skeleton, head, dims, branch_k)
    if vocab_note:
        progress(vocab_note)
    progress(f"loaded {dims.family} target's config and tensor index ({dims.layers} layers, "
             f"{checkpoint.nbytes() / 1e9:.2f} GB in "
             f"{len({e.file for e in checkpoint.entries.values()})} safetensors files) and head "
             f"({dims.head_layers} layers, block {dims.block_size}); exporting as {dtype}, "
             f"{estimate.graphs / 1e9:.2f} GB of graphs, estimated peak {estimate.peak / GIB:.1f} GiB")
    # quantized straight from the trace where the TorchScript exporter leaves the weights to the writer
    streamed = scheme is not None and opset < ATTENTION_OPSET
    hashes = SourceHashes(snapshot.path)
    with atomic_directory(out, ARTIFACTS_FORMAT, "glance-export onnx") as tmp:
        quantized: dict[str, QuantizedGraph] = {}
        for name, feed in trace_feeds(snapshot, dims, DTYPES[dtype]).items():
            t0 = time.perf_counter()
            module = graphs[name]
            axes = dynamic_axes(dims, name, module.input_names, module.output_names)
            weights = InMemory() if name in HEAD_GRAPHS else skeleton
            if streamed and name in QUANTIZED_GRAPHS:
                quantized[name] = export_quantized(module, feed, tmp, name, axes, opset,
                                                   output_shapes(dims, name, branch_k), weights, scheme,
                                                   name in VOCABULARY_GRAPHS, progress)
                continue
            layers = dims.layers if name == "target" else 0
            path = export_graph(module, feed, tmp / f"{name}.onnx", axes, opset, output_shapes(dims, name, branch_k),
                                weights, lm_head_gemm=name in VOCABULARY_GRAPHS,
                                on_tensor=eta_reporter(f"{name}.onnx", layers, progress))
            progress(f"exported {path.name} (opset {opset}, {_graph_bytes(path) / 1e6:.1f} MB) "
                     f"in {time.perf_counter() - t0:.1f}s; checker passed")
        if streamed:
            validate_quantized(tmp, graphs, quantized, skeleton, dims, snapshot, opset, _attention(opset), branch_k,
                               scheme, 1, progress)
            validate_graphs(tmp, {k: v for k, v in graphs.items() if k not in quantized}, dims, snapshot, dtype,
                            skeleton, seed=1, progress=progress)
            quantization = quantization_record(scheme, {name: graph.entry for name, graph in quantized.items()})
        else:
            _validate(tmp, graphs, skeleton, dims, snapshot, dtype, opset, branch_k, 1, progress)
            quantization = quantize_graphs(tmp, scheme, progress) if scheme else None
        files = copy_runtime_files(snapshot, tmp)
        if (Path(head_dir) / CALIBRATION).is_file():  # refittable, so not hashed into the manifest
            shutil.copy2(Path(head_dir) / CALIBRATION, tmp / CALIBRATION)
            files_note = f"{', '.join(files)} and the head's {CALIBRATION}"
        else:
            files_note = ", ".join(files)
        progress(f"copied {files_note}; writing the manifest (the source weights were hashed beside the export)")
        manifest = build_manifest(snapshot, head, Path(head_dir), dims, tmp, dtype=dtype, opset=opset,
                                  branch_k=branch_k, max_tree=max_tree, max_context=max_context,
                                  axes=axis_bounds(dims, max_tree, max_context, branch_k), files=files,
                                  quantization=quantization, weights_sha256=hashes.result())
        artifacts_format.write(tmp, manifest)
    progress(f"wrote {out} in {time.perf_counter() - started:.1f}s")
    return out


def validate_artifacts(artifacts_dir: str | Path, model_dir: str | Path, head_dir: str | Path, *, seed: int = 1,
                       progress: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """Re-validate an artifacts directory against the torch target and head it was exported from."""
    artifacts = Path(artifacts_dir)
    return_freed_weights()
    manifest = artifacts_format.read(artifacts)
    dtype, opset = manifest.dtype, manifest.opset
    snapshot, checkpoint, head = open_sources(model_dir, head_dir, dtype)
    skeleton = target_skeleton(snapshot, checkpoint, dtype, _attention(opset))
    dims = dims_for(snapshot, head, manifest.max_batch)
    graphs = build_graphs(skeleton, head, dims, manifest.branch_k)
    return _validate(artifacts, graphs, skeleton, dims, snapshot, dtype, opset, manifest.branch_k, seed, progress)


def _graph_bytes(path: Path) -> int:
    data = path.with_name(f"{path.name}.data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def _validate(out: Path, graphs: dict, skeleton: Skeleton, dims, snapshot, dtype: str, opset: int, branch_k: int,
              seed: int, progress: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """Every graph against torch; the target whole when small, else as a depth cut plus a full-depth smoke run."""
    others = {k: v for k, v in graphs.items() if k != "target"}
    report = {"target": validate_target(out, graphs["target"], skeleton, dims, snapshot, dtype, opset,
                                        _attention(opset), branch_k, seed, progress)}
    validated("target", graphs["target"], report["target"],
              len(validation_feeds("target", dims, snapshot, dtype, seed)), progress)
    report.update(validate_graphs(out, others, dims, snapshot, dtype, skeleton, seed=seed, progress=progress))
    return report
