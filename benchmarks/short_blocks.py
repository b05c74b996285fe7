"""A draft sized to the round: acceptance and draft cost of short blocks against whole ones, on ONNX Runtime.

A round that uses d depths drafts over the anchor, d masks and a few more rows (`decode.backend.block_rows`)
instead of the whole block. Both sides are measured through the same backend and graphs, the whole block by
opening the graphs as an export that cannot draft short blocks would be opened (the manifest without its `Bk`
axis), so nothing but the block's length differs:

    python benchmarks/short_blocks.py tau OUT.json [--artifacts ART] [--prompts 20] [--budgets 3:1,7:1,7:8,15:8]
    python benchmarks/short_blocks.py cost OUT.json --artifacts ART [--threads 2] [--repeats 15]

`tau`: each task file's first N prompts (default: the embedded model's held-out tasks, `examples/*/tasks.jsonl`)
decoded at each budget:k with whole and with short blocks; tokens per drafted round (pooled), and whether the
answers are identical (they must be: drafts never change an answer). `cost`: one prompt prefilled, then drafts
of every depth 1..B-1, both block lengths, interleaved repeat by repeat (first pass a warm-up), the fastest and
median ms of each. Load average before and after is recorded: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime")]

from glance_runtime.backends.ort_backend import OrtBackend  # noqa: E402
from glance_runtime.decode.backend import block_rows  # noqa: E402
from glance_runtime.decode.loop import DecodeConfig, decode  # noqa: E402
from glance_runtime.defaults import DEFAULT_ARTIFACTS  # noqa: E402
from glance_runtime.formats.tasks import read as read_tasks  # noqa: E402
from glance_runtime.prompt.codec import exported_codec  # noqa: E402

KINDS = ("receipt", "chart", "scene", "caption")
TEXT = "Describe the weather in a short poem, then list three colours and explain each one."


def whole_blocks(backend: OrtBackend, whole: bool) -> None:
    """Open the graphs as if they drafted whole blocks only (or as they are)."""
    m = backend.base_manifest
    axes = {k: v for k, v in m.axes.items() if k not in ("Bk", "Bd")} if whole else m.axes
    backend.manifest = dataclasses.replace(m, axes=axes)


def open_backend(artifacts: Path, threads: int | None) -> OrtBackend:
    backend = OrtBackend(artifacts, threads=threads)
    backend.base_manifest = backend.manifest
    if not backend.manifest.short_blocks:
        raise SystemExit(f"{artifacts} drafts whole blocks only: re-export it with this toolkit's glance-export onnx")
    return backend


def tau(args: argparse.Namespace) -> dict:
    backend = open_backend(args.artifacts, args.threads)
    codec = exported_codec(backend.manifest)
    files = args.data or [ROOT / "examples" / kind / "tasks.jsonl" for kind in KINDS]
    tasks = [task for path in files for task in read_tasks(path)[:args.prompts]]
    prompts = [codec.turn(task.prompt, task.image) for task in tasks]
    rows = []
    for spec in args.budgets.split(","):
        budget, k = (int(x) for x in spec.split(":"))
        cfg = DecodeConfig(max_new_tokens=args.new_tokens, budget=budget, branch_k=k)
        result = {"budget": budget, "branch_k": k, "depth_rows": block_rows(backend.block_size, budget)}
        answers = {}
        for side in ("whole", "short"):
            whole_blocks(backend, side == "whole")
            accepted = rounds = 0
            answers[side] = []
            for prompt in prompts:
                out = decode(backend, prompt, cfg, codec.stop_ids)
                drafted = [r for r in out.rounds if r.drafted]
                accepted += sum(r.accepted for r in drafted)
                rounds += len(drafted)
                answers[side].append(out.tokens)
            result[f"tau_{side}"] = accepted / max(rounds, 1)
        result["identical"] = answers["whole"] == answers["short"]
        rows.append(result)
        print(f"budget {budget} k {k}: tau whole {result['tau_whole']:.3f}, short ({result['depth_rows']} rows) "
              f"{result['tau_short']:.3f}, answers identical {result['identical']}", flush=True)
    return {"artifacts": str(args.artifacts), "prompts": len(prompts), "new_tokens": args.new_tokens,
            "block_size": backend.block_size, "rows": rows}


def cost(args: argparse.Namespace) -> dict:
    backend = open_backend(args.artifacts, args.threads)
    codec = exported_codec(backend.manifest)
    anchor = backend.prefill(codec.turn(TEXT)).first
    k = backend.manifest.branch_k
    depths = list(range(1, backend.block_size))
    times: dict[tuple[str, int], list[float]] = {(side, d): [] for side in ("whole", "short") for d in depths}
    for repeat in range(args.repeats + 1):
        order = [(side, d) for d in depths for side in ("whole", "short")]
        for side, depth in order if repeat % 2 else order[::-1]:
            whole_blocks(backend, side == "whole")
            t0 = time.perf_counter()
            backend.draft(anchor, k, depth)
            if repeat:  # the first pass warms up (and takes in the prompt's rows)
                times[side, depth].append((time.perf_counter() - t0) * 1e3)
        print(f"repeat {repeat}/{args.repeats}", flush=True)
    rows = [{"depth": d, "rows_short": block_rows(backend.block_size, d), "rows_whole": backend.block_size,
             **{f"{side}_{stat}": round(fn(times[side, d]), 3) for side in ("whole", "short")
                for stat, fn in (("fastest_ms", min), ("median_ms", statistics.median))}} for d in depths]
    for row in rows:
        print(f"depth {row['depth']:2d}: whole block {row['whole_median_ms']:8.2f} ms, short "
              f"({row['rows_short']:2d} rows) {row['short_median_ms']:8.2f} ms")
    return {"artifacts": str(args.artifacts), "threads": args.threads, "repeats": args.repeats, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("tau", "cost"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    ap.add_argument("--data", type=Path, nargs="*")
    ap.add_argument("--prompts", type=int, default=20, help="prompts from each task file (tau)")
    ap.add_argument("--budgets", default="3:1,7:1,7:8,15:8", help="budget:branch_k pairs (tau)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--repeats", type=int, default=15, help="timed passes (cost)")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    report = tau(args) if args.what == "tau" else cost(args)
    report.update(load_before=load_before, load_after=os.getloadavg()[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} (load {load_before:.2f} before, {report['load_after']:.2f} after)")


if __name__ == "__main__":
    main()
