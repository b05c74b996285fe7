"""AR vs speculative decoding on one backend in one process, interleaved; plus the loop's own overhead.

    python benchmarks/bench_loop.py --artifacts ART [--image IMG] [--prompt TEXT] [--samples 6]
    python benchmarks/bench_loop.py --artifacts ART --tasks examples/receipt/tasks.jsonl --limit 10
    python benchmarks/bench_loop.py --backend torch --model SNAP --head HEAD ...

Each sample runs AR and speculative decoding back to back, alternating which goes first; sample 0
of every task is a warm-up and is dropped. ms/token is reported without prefill (rounds only) and
with it. tau pools rounds; tasks combine by the geometric mean of their speedups. For ONNX Runtime the graph runs are timed, so
each round splits into target, draft and vocab graph time and everything else (tree build, uploads,
embedding copies, KV compaction, walk): the "outside" share, whose target is <= 15%.

`--seed-drafts full|partial` replaces the head's top-k at each offset with the backend's own AR
output (placed first), so acceptance is what a good head would get: an upper bound that shows the
loop's speed at a given tau, not a measurement of any trained head.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.backends.graph_clock import GRAPH_NAMES, GraphClock
from glance_runtime.decode.loop import DecodeConfig, DecodeResult, decode


def open_backend(args):
    if args.backend == "onnxruntime":
        from glance_runtime.backends.ort_backend import OrtBackend
        from glance_runtime.prompt.codec import exported_codec

        backend = OrtBackend(args.artifacts, providers=args.provider, threads=args.threads)
        codec = exported_codec(backend.manifest)
        return backend, codec.turn, codec.stop_ids, backend.time_graphs()
    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import load_head
    from glance_export.model.torch_backend import TorchBackend

    snapshot = Snapshot(args.model)
    backend = TorchBackend(snapshot, load_head(args.head))
    return backend, snapshot.build_prompt, snapshot.stop_token_ids, None


def run_once(backend, clock: GraphClock | None, prompt, cfg: DecodeConfig,
             stops) -> tuple[DecodeResult, dict[str, float] | None]:
    """One decode; also the graph-run seconds of its rounds by graph (the clock read after prefill and at the end)."""
    if clock is None:
        return decode(backend, prompt, cfg, stop_ids=stops), None
    readings: list[dict[str, float]] = []
    result = decode(backend, prompt, cfg, stop_ids=stops, on_commit=lambda _new, _reports: readings.append(clock.reading()))
    return result, {name: (readings[-1][name] - readings[0][name]) / 1e3 for name in GRAPH_NAMES}


def summarize(kept: list[tuple[DecodeResult, dict[str, float] | None]]) -> dict:
    """ms/token (median over samples), pooled tau, and the per-round split of one mode on one task."""
    results = [r for r, _ in kept]
    rounds = [rd for r in results for rd in r.rounds]
    round_ms = sum(rd.total_ms for rd in rounds)
    entry = {"ms_per_token_decode": statistics.median(r.ms_per_token_decode for r in results),
             "ms_per_token_with_prefill": statistics.median(r.ms_per_token for r in results),
             "prefill_ms": statistics.median(r.prefill_ms for r in results),
             "accepted": sum(rd.accepted for rd in rounds), "rounds": len(rounds),
             "tau": sum(rd.accepted for rd in rounds) / len(rounds), "round_ms": round_ms / len(rounds),
             "mean_tree_size": float(np.mean([rd.tree_size for rd in rounds]))}
    graph = [g for _, g in kept]
    if all(g is not None for g in graph):
        seconds = {name: sum(g[name] for g in graph) for name in GRAPH_NAMES}
        entry["outside_graph_share"] = 1 - sum(seconds.values()) * 1e3 / round_ms
        for name, s in seconds.items():
            entry[f"{name}_graph_ms_per_round"] = s * 1e3 / len(rounds)
    return entry


def measure(backend, clock, prompt, stops, args) -> dict:
    """Interleaved AR and speculative samples of one prompt; the first sample of each is dropped."""
    ar_cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, speculative=False)
    spec_cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, budget=args.budget, branch_k=args.branch_k)
    truth = decode(backend, prompt, ar_cfg, stop_ids=stops).tokens
    spec_backend = backend
    if args.seed_drafts != "none":
        depth = backend.block_size - 1 if args.seed_drafts == "full" else max(1, (backend.block_size - 1) // 2)
        spec_backend = SeededDrafter(backend, truth, prompt.length, lambda d: 0 if d <= depth else None)
    runs: dict[str, list] = {"ar": [], "spec": []}
    for i in range(args.samples):
        order = [("ar", backend, ar_cfg), ("spec", spec_backend, spec_cfg)]
        for name, b, cfg in (order if i % 2 == 0 else order[::-1]):
            result, graph_s = run_once(b, clock, prompt, cfg, stops)
            if result.tokens != truth:
                raise SystemExit(f"{name} sample {i} diverged from AR: lossless decoding is broken")
            runs[name].append((result, graph_s))
    out = {"prompt_tokens": prompt.length, "new_tokens": len(truth), **{k: summarize(v[1:]) for k, v in runs.items()}}
    out["speedup_decode"] = out["ar"]["ms_per_token_decode"] / out["spec"]["ms_per_token_decode"]
    out["speedup_with_prefill"] = out["ar"]["ms_per_token_with_prefill"] / out["spec"]["ms_per_token_with_prefill"]
    return out


def load_tasks(args) -> list[tuple[str, Path | None]]:
    """(prompt, image) pairs: from a tasks.jsonl (images relative to it) or the single --prompt/--image."""
    if args.tasks is None:
        return [(args.prompt, args.image)]
    lines = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()][: args.limit]
    return [(t["prompt"], args.tasks.parent / t["image"] if t.get("image") else None) for t in lines]


def report(name: str, task: dict) -> None:
    print(f"{name}: prompt {task['prompt_tokens']} tokens, {task['new_tokens']} new")
    for mode in ("ar", "spec"):
        e = task[mode]
        split = (f"; round {e['round_ms']:.2f} ms = target {e['target_graph_ms_per_round']:.2f} + draft "
                 f"{e['draft_graph_ms_per_round']:.2f} + vocab {e['vocab_graph_ms_per_round']:.2f} + outside "
                 f"{e['outside_graph_share']:.1%}" if "outside_graph_share" in e else f"; round {e['round_ms']:.2f} ms")
        print(f"  {mode:4s} {e['ms_per_token_decode']:8.3f} ms/token excl. prefill "
              f"({e['ms_per_token_with_prefill']:.3f} incl. prefill {e['prefill_ms']:.1f} ms), tau {e['tau']:.2f}{split}")
    print(f"  speedup {task['speedup_decode']:.2f}x excl. prefill, {task['speedup_with_prefill']:.2f}x incl.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("onnxruntime", "torch"), default="onnxruntime")
    ap.add_argument("--artifacts", type=Path)
    ap.add_argument("--provider", action="append", help="onnxruntime execution provider (repeatable); default CPU")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--head", type=Path)
    ap.add_argument("--prompt", default="Describe the image.")
    ap.add_argument("--image", type=Path)
    ap.add_argument("--tasks", type=Path, help="tasks.jsonl ({prompt, image}) instead of --prompt/--image")
    ap.add_argument("--limit", type=int, default=None, help="first N tasks only")
    ap.add_argument("--samples", type=int, default=6, help="per task, including the dropped warm-up sample")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=63)
    ap.add_argument("--branch-k", type=int, default=8)
    ap.add_argument("--seed-drafts", choices=("none", "partial", "full"), default="none")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = ap.parse_args()
    if args.samples < 2:
        ap.error("--samples must be at least 2 (the first is a dropped warm-up)")

    backend, build_prompt, stops, clock = open_backend(args)
    print(f"{backend.name} {', '.join(backend.info.providers)}: budget {args.budget}, branch {args.branch_k}, "
          f"block {backend.block_size}, drafts {args.seed_drafts}, {args.samples - 1} samples kept per task "
          "(first dropped as warm-up)")
    tasks = []
    for i, (text, image) in enumerate(load_tasks(args)):
        tasks.append(measure(backend, clock, build_prompt(text, image), stops, args))
        report(f"task {i} ({text[:40]!r}{', ' + image.name if image else ''})", tasks[-1])
    speedups = [t["speedup_decode"] for t in tasks]
    overall = {"tasks": len(tasks), "geomean_speedup_decode": float(np.exp(np.mean(np.log(speedups)))),
               "geomean_speedup_with_prefill": float(np.exp(np.mean(np.log([t["speedup_with_prefill"] for t in tasks])))),
               "tau_pooled": sum(t["spec"]["accepted"] for t in tasks) / sum(t["spec"]["rounds"] for t in tasks)}
    print(f"overall: {len(tasks)} tasks, tau {overall['tau_pooled']:.2f} (pooled rounds), geomean speedup "
          f"{overall['geomean_speedup_decode']:.2f}x excl. prefill, {overall['geomean_speedup_with_prefill']:.2f}x incl.")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "overall": overall,
                                         "tasks": tasks}, indent=2))


if __name__ == "__main__":
    main()
