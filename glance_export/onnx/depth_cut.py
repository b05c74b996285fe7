"""Validating a target graph that is too large to hold twice (torch beside ONNX Runtime).

A small target is validated whole against its torch wrapper, as every other graph is. A large one is
validated in two parts that together keep that strength without two full models in memory:
- a depth-cut graph: the same snapshot's first `CUT_LAYERS` layers, built, traced and streamed by the
  same code as the full graph, is compared with torch on the same fresh inputs. Every layer of a stack
  is the same code on different weights, so what the comparison proves of the wiring (cache, mask,
  rotary, taps, deepstack rows) holds at any depth;
- a full-depth smoke run: ONNX Runtime loads the exported graph itself (its weights memory-mapped from
  the data file, no prepacked copies) and runs a prefill and a tree pass, whose outputs must have the
  contract's shapes and be finite. That proves the full graph's wiring and every streamed tensor load.
  It runs in a child process: the pages of the data file it maps are resident while it runs (clean
  page cache the kernel can reclaim, not a copy), and leave with it instead of staying in the
  exporter's resident set for the rest of the export.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
from torch import nn

from glance_runtime.errors import GlanceError

from .export import export_graph, weight_bytes
from .feeds import target_feed, trace_feeds
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
    """Max error per output of the target graph (whole, or its depth cut); raises GlanceError on failure."""
    tol = TOLERANCES[dtype]
    if weight_bytes(full) <= FULL_VALIDATION_BYTES or dims.layers <= CUT_LAYERS:
        with skeleton.materialized(full):
            return validate_graph("target", out_dir / "target.onnx", full,
                                  validation_feeds("target", dims, snapshot, dtype, seed), tol)
    small = cut_dims(dims, CUT_LAYERS)
    cut = target_skeleton(snapshot, skeleton.checkpoint, dtype, attention, layers=CUT_LAYERS)
    module = target_graph(cut.model, small)
    scratch = Path(tempfile.mkdtemp(prefix=".cut.", dir=out_dir))
    try:
        axes = dynamic_axes(small, "target", module.input_names, module.output_names)
        path = export_graph(module, trace_feeds(snapshot, small, DTYPES[dtype])["target"], scratch / "target.onnx",
                            axes, opset, output_shapes(small, "target", branch_k), cut)
        with cut.materialized(module):
            errors = validate_graph("target", path, module, validation_feeds("target", small, snapshot, dtype, seed), tol)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    progress(f"validated a {CUT_LAYERS}-layer cut of target.onnx against torch; smoke-running all {dims.layers} layers")
    smoke_in_child(out_dir / "target.onnx", dims, dtype, seed)
    return errors


def smoke_in_child(path: Path, dims: Dims, dtype: str, seed: int) -> None:
    """`smoke_run` in a fresh interpreter; its one-line failure becomes this process's GlanceError."""
    spec = json.dumps({"path": str(path), "dims": dataclasses.asdict(dims), "dtype": dtype, "seed": seed})
    done = subprocess.run([sys.executable, "-m", __name__, spec], capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise GlanceError(f"full-depth smoke run of {path.name} failed: {lines[-1]}")


def smoke_run(path: Path, dims: Dims, dtype: str, seed: int) -> None:
    """A prefill and a tree-verify pass of the full graph in ONNX Runtime: contract shapes, finite values."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")  # packed weights would be a second copy
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    names = [o.name for o in session.get_outputs()]
    for feed in (target_feed(dims, rng, 7, 0, 2, DTYPES[dtype], tree=False),
                 target_feed(dims, rng, 5, 7, 0, DTYPES[dtype], tree=True)):
        rows = feed["tree_mask"].shape[0]
        wanted = {i.name for i in session.get_inputs()}
        for name, value in zip(names, session.run(names, {k: v for k, v in feed.items() if k in wanted})):
            if value.shape[0] != rows:
                raise GlanceError(f"target graph: output {name} has {value.shape[0]} rows for a {rows}-row pass")
            if not np.isfinite(value).all():
                raise GlanceError(f"target graph: output {name} is not finite at full depth")


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    fields = {**job["dims"], "tap_ids": tuple(job["dims"]["tap_ids"])}
    try:
        smoke_run(Path(job["path"]), Dims(**fields), job["dtype"], job["seed"])
    except GlanceError as exc:
        sys.exit(str(exc))
