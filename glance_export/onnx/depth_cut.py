"""Validating a target graph that is too large to hold twice (torch beside ONNX Runtime).

A small target is validated whole against its torch wrapper, as every other graph is. A large one is
validated in two parts that together keep that strength without two full models in memory:
- a depth-cut graph: the same snapshot's first `CUT_LAYERS` layers, built and traced by the same code
  as the full graph, its weights read from the full graph's own data file (so the check covers those
  bytes, and nothing is written twice), is compared with torch on the same fresh inputs. Every layer
  of a stack is the same code on different weights, so what the comparison proves of the wiring (cache, mask,
  rotary, taps, deepstack rows) holds at any depth;
- a full-depth smoke run: ONNX Runtime runs the exported graph itself, every node and every weight of
  it, on a lone sequence's prefill and a batch of trees, whose outputs must have the contract's shapes
  and be finite. That proves the full graph's wiring and every streamed tensor load. It runs segment by segment (see
  `segments.py`), so at most a few hundred MB of the graph's weights are loaded at once.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx.external_data_helper import uses_external_data
from torch import nn

from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import TARGET_GRAPH

from .export import ATTENTION_OPSET, export_graph, weight_bytes
from .feeds import target_feed, trace_feeds
from .segments import SEGMENT_BYTES, run_in_segments
from .sources import target_graph, target_skeleton
from .spec import DTYPES, Dims, dynamic_axes, output_shapes
from .validate import TOLERANCES, validate_graph, validation_feeds

FULL_VALIDATION_BYTES = 256 << 20  # a target stack up to this size is validated whole against torch
CUT_LAYERS = 2


def cut_dims(dims: Dims, layers: int) -> Dims:
    """The sizes of the first `layers` layers: taps past the cut read its last layer, deepstack rows stop there."""
    return dataclasses.replace(dims, layers=layers, tap_ids=tuple(min(t, layers - 1) for t in dims.tap_ids),
                               deepstack=min(dims.deepstack, layers))


def validate_target(out_dir: Path, full: nn.Module, skeleton, dims: Dims, snapshot, dtype: str, opset: int,
                    attention: str, branch_k: int, seed: int, progress: Callable[[str], None]) -> dict[str, float]:
    """Max error per output of the target graph, whole or as its depth cut; raises GlanceError on failure."""
    tol = TOLERANCES[dtype]
    full_path = out_dir / TARGET_GRAPH
    if weight_bytes(full) <= FULL_VALIDATION_BYTES or dims.layers <= CUT_LAYERS:
        return validate_graph("target", full_path, full, validation_feeds("target", dims, snapshot, dtype, seed), tol,
                              skeleton.materialized)
    small = cut_dims(dims, CUT_LAYERS)
    cut = target_skeleton(snapshot, skeleton.checkpoint, dtype, attention, layers=CUT_LAYERS)
    module = target_graph(cut.model, small)
    progress(f"smoke-running all {dims.layers} layers of {full_path.name} in ONNX Runtime")
    smoke_run(full_path, dims, dtype, seed, budget=weight_bytes(module))  # no more than the cut holds
    borrow = full_path if opset < ATTENTION_OPSET and external(full_path) else None
    scratch = Path(tempfile.mkdtemp(prefix=".cut.", dir=out_dir))
    path = out_dir / f"{scratch.name}.{TARGET_GRAPH}" if borrow else scratch / TARGET_GRAPH
    try:
        axes = dynamic_axes(small, "target", module.input_names, module.output_names)
        export_graph(module, trace_feeds(snapshot, small, DTYPES[dtype])["target"], path, axes, opset,
                     output_shapes(small, "target", branch_k), cut, borrow=borrow)
        errors = validate_graph("target", path, module, validation_feeds("target", small, snapshot, dtype, seed), tol,
                                cut.materialized)
    finally:
        path.unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    cut_line = f"validated a {CUT_LAYERS}-layer cut of {full_path.name} against torch"
    progress(f"{cut_line} (its weights read from {TARGET_GRAPH}.data)" if borrow else cut_line)
    return errors


def external(path: Path) -> bool:
    """Whether the graph keeps its weights in a data file."""
    return any(uses_external_data(t) for t in onnx.load(str(path), load_external_data=False).graph.initializer)


def smoke_run(path: Path, dims: Dims, dtype: str, seed: int, budget: int = SEGMENT_BYTES,
              prepack: bool = False) -> None:
    """A lone sequence's prefill and a batch of trees over ragged pasts through the full graph in ONNX Runtime:
    contract shapes, finite values (`prepack`: see `run_in_segments`)."""
    rng = np.random.default_rng(seed)
    feeds = [target_feed(dims, rng, 7, [0], [0], (1, 9), 2, DTYPES[dtype], tree=False),
             target_feed(dims, rng, 5, [1, 0], [7, 3], (3, 9), 0, DTYPES[dtype], tree=True)]
    for feed, outputs in zip(feeds, run_in_segments(path, feeds, budget, prepack)):
        rows = feed["tree_mask"].shape[:-1]  # [B, T]
        for name, value in outputs.items():
            if value.shape[:len(rows)] != rows:
                raise GlanceError(f"full-depth smoke run of {path.name}: output {name} has shape {value.shape} "
                                  f"for a {'x'.join(map(str, rows))}-row pass")
            if not np.isfinite(value).all():
                raise GlanceError(f"full-depth smoke run of {path.name}: output {name} is not finite")
