"""Packed or padded: how a batch of sequences should share one target pass on ONNX Runtime CPU.

Batching B requests means one target run over every sequence's rows instead of B runs. Two layouts:
- packed: all rows in one sequence under one mask, every row attending over the union of the B contexts (the
  graph stays as it is, its mask grows to [T, S + T] with S the sum of the contexts);
- padded: a batch axis, each sequence attending over its own context only (rows padded to the longest).
This times the shipped default target graph (`models/glance-vl-tiny-onnx/target.onnx`, one sequence a pass) three ways for B sequences
of `--context` committed rows and R rows each (1: plain decoding; 8: a small tree): B separate runs (today's one
request at a time), one packed run (B x R rows over B x context past rows), and the padded layout's cost as one
run of B x R rows over one context (its attention per row is one sequence's; a graph with a batch axis does the
same arithmetic in B blocks, so this is what padding can reach at best, padding rows aside).

    python benchmarks/batch_layouts.py [--batch 8] [--context 150] [--rows 1,4,8] [--threads 1] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GRAPH = ROOT / "models" / "glance-vl-tiny-onnx" / "target.onnx"


def session(threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(GRAPH), options, providers=["CPUExecutionProvider"])


def feeds(sess, rows: int, past: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of one pass of one sequence: `rows` new rows (causal among themselves) after `past` committed rows,
    read from a one-slot pool of `past` rows."""
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    hidden = shapes["inputs_embeds"][2]
    kv = shapes["pool_key_0"][2:]
    out = {"input_ids": np.zeros((1, rows), np.int64),
           "inputs_embeds": rng.standard_normal((1, rows, hidden)).astype(np.float32),
           "image_embeds": np.zeros((0, hidden), np.float32),
           "position_ids": np.tile(np.arange(past, past + rows), (3, 1, 1)),
           "tree_mask": np.tri(rows, dtype=bool)[None], "slots": np.zeros(1, np.int64),
           "past_lengths": np.array([past], np.int64), "past_rows": np.arange(past, dtype=np.int64)}
    for name in shapes:
        if name.startswith("pool_"):
            out[name] = rng.standard_normal((1, max(past, 1), *kv)).astype(np.float32)
    return {k: v for k, v in out.items() if k in shapes}


def median_ms(sess, inputs: dict[str, np.ndarray], runs: int) -> float:
    sess.run(None, inputs)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, inputs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=150, help="committed rows of each sequence")
    parser.add_argument("--rows", default="1,4,8", help="rows each sequence adds to a pass (1: plain decoding)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sess, rng = session(args.threads), np.random.default_rng(0)
    b, ctx = args.batch, args.context
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        one = median_ms(sess, feeds(sess, rows, ctx, rng), args.runs)
        packed = median_ms(sess, feeds(sess, b * rows, b * ctx, rng), args.runs)
        padded = median_ms(sess, feeds(sess, b * rows, ctx, rng), args.runs)
        results.append({"rows": rows, "one_ms": round(one, 3), "separate_ms": round(b * one, 3),
                        "packed_ms": round(packed, 3), "padded_bound_ms": round(padded, 3)})
    load = os.getloadavg()[0]
    lines = [f"# Packed or padded batches (ONNX Runtime CPU, {args.threads} thread(s), load {load:.2f})", "",
             f"`python benchmarks/batch_layouts.py --batch {b} --context {ctx} --rows {args.rows} "
             f"--threads {args.threads}`: {b} sequences of {ctx} committed rows, median of {args.runs} runs.", "",
             f"| rows a sequence | one sequence | {b} separate runs | packed ({b * ctx} past rows) | "
             "padded (at best) |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['rows']} | {r['one_ms']} ms | {r['separate_ms']} ms | {r['packed_ms']} ms | "
                     f"{r['padded_bound_ms']} ms |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batch_layouts.md").write_text("\n".join(lines) + "\n")
        (args.out / "batch_layouts.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                 "load": load, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
