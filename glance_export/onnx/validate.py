"""Graph-level validation: each ONNX graph in ONNX Runtime (CPU) against its torch wrapper.

Fresh random inputs with shapes unlike the trace's (a lone sequence's prefill with image rows, a branching
tree over a non-empty past and a single-row decode; a ragged batch over non-contiguous slots; two image
sizes; one and many vocab rows) catch sizes the tracer froze. Floats must agree to
`atol + rtol * max|reference|` per output; top-k ids (column 0 is the greedy token) must be identical
wherever the reference has a clear margin (near-ties may legitimately flip), and their embeddings
wherever the ids agree.

Not Polygraphy's Comparator: its reference runner would be ONNX Runtime or TensorRT, not our torch
wrappers, and its per-output tolerances cannot express "top-k ids must match where the reference's
margin is clear", which is the comparison that matters for greedy parity.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

import numpy as np
import torch
from torch import nn

from glance_runtime.errors import GlanceError
from glance_runtime.formats.graphs import VOCABULARY_GRAPHS

from . import eagle3_draft
from .export import torch_args
from .feeds import draft_feed, target_feed, vision_feed, vocab_feed
from .node_runs import weight_bytes
from .segments import SEGMENT_BYTES, run_in_segments
from .spec import DTYPES, Dims


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float  # times the largest |value| of the reference output
    margin: float  # logit / log-prob gap above which ids must match exactly


ID_OUTPUTS = ("topk_ids",)  # reported as mismatch counts, not errors
TOLERANCES = {"fp32": Tolerance(atol=1e-4, rtol=1e-4, margin=1e-3),
              "fp16": Tolerance(atol=2e-2, rtol=2e-2, margin=0.25)}


def validation_feeds(graph: str, dims: Dims, snapshot, dtype: str, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype]
    if graph == "target":  # a lone sequence: prefill with image rows into slot 0, a tree over a past, one row;
        # then a ragged batch in non-contiguous slots (one past empty) with image rows over its flattened rows
        return [target_feed(dims, rng, 9, [0], [0], (2, 12), 3, np_dtype, tree=False),
                target_feed(dims, rng, 11, [2], [5], (3, 16), 1, np_dtype, tree=True),
                target_feed(dims, rng, 1, [1], [4], (2, 8), 0, np_dtype, tree=True),
                target_feed(dims, rng, 5, [3, 0, 4, 1], [0, 7, 4, 1], (6, 12), 2, np_dtype, tree=True)]
    if graph == "draft" and dims.head_kind == "eagle3":
        return eagle3_draft.validation_feeds(dims, rng, np_dtype)
    if graph == "draft":  # a lone sequence's first block (no past) and a later, short one; a ragged batch (one
        # past empty) of whole blocks, and one of the shortest
        return [draft_feed(dims, rng, [7], 7, [0], [0], (2, 12), np_dtype),
                draft_feed(dims, rng, [3], 3, [1], [6], (2, 12), np_dtype, block=min(3, dims.block_size)),
                draft_feed(dims, rng, [3, 0, 1, 3], 3, [3, 0, 4, 1], [0, 7, 4, 1], (6, 12), np_dtype),
                draft_feed(dims, rng, [2, 1], 2, [1, 0], [2, 5], (2, 12), np_dtype, block=2)]
    if graph in VOCABULARY_GRAPHS:
        size = dims.draft_vocab if graph == "draft_vocab" else dims.vocab
        return [vocab_feed(dims, rng, 9, 7, np_dtype, size), vocab_feed(dims, rng, 1, 1, np_dtype, size)]
    return [vision_feed(snapshot, dims, rng, 150, 100, np_dtype), vision_feed(snapshot, dims, rng, 60, 220, np_dtype)]


def _clear(sorted_desc: np.ndarray, margin: float) -> np.ndarray:
    """Columns of a descending [rows, K] array separated from both neighbours by more than margin."""
    gaps = -np.diff(sorted_desc, axis=-1)
    left = np.concatenate([np.full_like(gaps[:, :1], np.inf), gaps], axis=-1)
    right = np.concatenate([gaps, np.zeros_like(gaps[:, :1])], axis=-1)  # the K-th's next value is unknown
    return (left > margin) & (right > margin)


def _reference(module: nn.Module, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*torch_args(module, feed))
    return [t.float().numpy() if t.is_floating_point() else t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def compare(graph: str, names: list[str], ref: list[np.ndarray], got: list[np.ndarray], tol: Tolerance,
            errors: dict[str, float]) -> None:
    """Raise GlanceError on the first output out of tolerance; record max errors into `errors`."""
    by_name, got_by_name = dict(zip(names, ref)), dict(zip(names, got))
    for name, r, g in zip(names, ref, got):
        if r.shape != g.shape:
            raise GlanceError(f"{graph} graph: output {name} has shape {g.shape}, torch gives {r.shape}")
        if name == "topk_embeds":  # rows of ids that flipped at a near-tie are different embeddings, rightly
            same = by_name["topk_ids"] == got_by_name["topk_ids"]
            r, g = r[same], g[same]
        if name == "topk_ids":
            clear = _clear(by_name["topk_logprobs"], tol.margin)
            bad = int((clear & (r != g)).sum())
            errors[name] = max(errors.get(name, 0), bad)
            if bad:
                raise GlanceError(f"{graph} graph: output topk_ids differs at {bad} clearly separated entries")
        elif np.issubdtype(r.dtype, np.integer):
            if not np.array_equal(r, g):
                raise GlanceError(f"{graph} graph: integer output {name} differs from torch")
        elif r.size:
            err = float(np.abs(g.astype(np.float64) - r).max())
            allowed = tol.atol + tol.rtol * float(np.abs(r).max())
            errors[name] = max(errors.get(name, 0.0), err)
            if not err <= allowed:
                raise GlanceError(f"{graph} graph: output {name} max error {err:.3g} exceeds {allowed:.3g}")


def validate_graph(graph: str, path: Path, module: nn.Module, feeds: list[dict[str, np.ndarray]],
                   tol: Tolerance, materialized: Callable[[nn.Module], ContextManager]) -> dict[str, float]:
    """Max error per output over all feeds (mismatch counts for ids); raises GlanceError on failure.

    Torch's outputs come first, with the module's real weights in place only for them (`materialized`),
    and ONNX Runtime runs the graph after they are gone, so the two never hold the weights at once (at
    3B width the fp32 vocabulary matrix alone is 1.2 GB in each). A graph over `SEGMENT_BYTES` of weights
    runs in segments (see `segments.py`): a whole session would hold an fp32 copy of every fp16 weight
    beside them, three times the vision tower's 1.2 GiB at its peak."""
    import onnxruntime as ort

    with materialized(module):
        references = [_reference(module, feed) for feed in feeds]
    if weight_bytes(path) > SEGMENT_BYTES:
        runs = run_in_segments(path, feeds, SEGMENT_BYTES)
        outputs = [[run[name] for name in module.output_names] for run in runs]
    else:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # fp16 graphs warn about CPU constant folding; not our concern here
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        inputs = [i.name for i in session.get_inputs()]
        outputs = [session.run(module.output_names, {n: feed[n] for n in inputs}) for feed in feeds]
    errors: dict[str, float] = {}
    for ref, got in zip(references, outputs):
        compare(graph, module.output_names, ref, got, tol, errors)
    return errors


def validate_graphs(out_dir: Path, graphs: dict[str, nn.Module], dims: Dims, snapshot, dtype: str, weights, *,
                    seed: int = 1, progress: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """Validate each graph file in out_dir against its wrapper, with the wrapper's real weights swapped in
    from `weights` only for its own check; returns max errors by graph and output."""
    report = {}
    for name, module in graphs.items():
        feeds = validation_feeds(name, dims, snapshot, dtype, seed)
        report[name] = validate_graph(name, Path(out_dir) / f"{name}.onnx", module, feeds, TOLERANCES[dtype],
                                      weights.materialized)
        validated(name, module, report[name], len(feeds), progress)
    return report


def validated(name: str, module: nn.Module, errors: dict[str, float], feeds: int,
              progress: Callable[[str], None]) -> None:
    worst = max((v for k, v in errors.items() if k not in ID_OUTPUTS), default=0.0)
    ids = ", ids identical where the margin is clear" if set(ID_OUTPUTS) & set(module.output_names) else ""
    progress(f"validated {name}.onnx in ONNX Runtime on {feeds} inputs (max float error {worst:.3g}{ids})")
