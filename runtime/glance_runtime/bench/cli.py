"""`glance-bench`: AR, GLANCE trees and chains on one backend, interleaved per prompt, with the law and plots.

    glance-bench --data examples/receipt/tasks.jsonl --data examples/chart/tasks.jsonl --out bench/ [--chain]
    glance-bench law bench/rounds.jsonl [--mode tree-63] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from .. import __version__
from ..defaults import resolve
from ..errors import GlanceError
from ..limits import check_decode
from ..cli_parser import OneLineParser, guarded
from ..runner import BACKENDS, open_runner
from .law_log import fit_log, select
from .markdown import law_table
from .measure import measure_prompt
from .modes import modes_for, parse_budgets
from .progress import Progress
from .report import clean_json, build, write
from .tasks import read_tasks
from .timing import GraphClock


def bench_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-bench", description="Speed, acceptance and the draftability law of "
                                "GLANCE against AR greedy decoding, measured side by side (see also "
                                "`glance-bench law ROUNDS.jsonl`).")
    p.add_argument("--data", type=Path, action="extend", nargs="+", required=True,
                   help="TASKS.jsonl (repeatable); a row's \"kind\", else the file's directory, names its task kind")
    p.add_argument("--out", type=Path, required=True, help="directory for report.json, report.md, rounds.jsonl, PNGs")
    p.add_argument("--backend", choices=BACKENDS, help="default: onnxruntime where installed, else torch")
    p.add_argument("--model", type=Path, help="target snapshot (default: the embedded glance-vl-tiny)")
    p.add_argument("--head", type=Path, help="draft head directory")
    p.add_argument("--artifacts", type=Path, help="exported graphs for onnxruntime (glance-export onnx)")
    p.add_argument("--engines", type=Path, help="TensorRT engines for --backend tensorrt (glance-export build)")
    p.add_argument("--provider", action="append", help="ONNX Runtime execution provider (repeatable)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads")
    p.add_argument("--budgets", default="7,15,31,63", help="tree budgets, comma-separated (default 7,15,31,63)")
    p.add_argument("--branch-k", type=int, default=8, help="top-k per draft offset for the trees")
    p.add_argument("--chain", action="store_true", help="also the same head as a chain (branch 1, min(budget, B-1) nodes)")
    p.add_argument("--n", type=int, help="first N prompts of each task file (default: all)")
    p.add_argument("--samples", type=int, default=3, help="runs per prompt and mode, the first dropped as a warm-up")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed-drafts", choices=("none", "partial", "full"), default="none",
                   help="seed the target's own greedy continuation into the draft top-k with confident log-probs "
                   "(an upper bound, for random heads): at every offset (full) or the first half (partial)")
    p.add_argument("--law-mode", help="whose rounds the law is fitted to (default: the largest tree budget)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates for intervals")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and permutation draws")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    return p


def law_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-bench law", description="Fit the draftability law "
                                "logit p = b0 - b1 H to a round log, per kind and pooled, with diagnostics.")
    p.add_argument("rounds", type=Path, help="rounds.jsonl from glance-bench (or JSON lines with entropy, accepted)")
    p.add_argument("--mode", help="which mode's rounds (default: the largest tree budget in the log)")
    p.add_argument("--cap", type=int, help="max drafted tokens per round where the log has no cap field (B - 1)")
    p.add_argument("--include-final", action="store_true", help="keep each answer's final round (its acceptance "
                   "is cut by the answer's end; left out by default)")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write law.json, law.md and law.png here")
    p.add_argument("--json", action="store_true", help="print the fits as JSON")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.samples < 2:
        raise GlanceError("--samples must be at least 2 (the first is a dropped warm-up)")
    if args.max_new_tokens < 2:
        raise GlanceError(f"--max-new-tokens {args.max_new_tokens} leaves no rounds to measure (prefill gives the "
                          "first token); pass 2 or more")
    if args.n is not None and args.n < 1:
        raise GlanceError("--n must be at least 1")
    if args.bootstrap < 1:
        raise GlanceError("--bootstrap must be at least 1")
    for flag, path in (("--model", args.model), ("--head", args.head), ("--artifacts", args.artifacts),
                       ("--engines", args.engines)):
        if path is not None and not path.is_dir():
            raise GlanceError(f"{flag} {path} {'is not a directory' if path.exists() else 'does not exist'}")
    if args.out.exists() and not args.out.is_dir():
        raise GlanceError(f"--out {args.out} is a file; pass a directory")


def _conditions(runner, args: argparse.Namespace, argv: list[str]) -> dict:
    providers = getattr(runner.backend, "providers", None)
    versions = {}
    for module in ("numpy", "onnxruntime"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            continue
    return {"command": "glance-bench " + " ".join(shlex.quote(a) for a in argv), "toolkit": __version__,
            "backend": runner.backend.name, "providers": ", ".join(providers) if providers else None,
            "threads": args.threads, "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions,
            "load_start": round(os.getloadavg()[0], 2), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    _check(args)
    budgets = parse_budgets(args.budgets)
    tasks = read_tasks(args.data, args.n)
    if not args.no_plots:
        from .plots import pyplot

        pyplot()
    model, head, artifacts, backend = resolve(args.model, args.head, args.artifacts, args.backend)
    ort = {} if backend == "torch" else dict(providers=args.provider, threads=args.threads)
    runner = open_runner(backend, model=model, head=head, artifacts=artifacts, engines=args.engines,
                         progress=lambda line: print(line, file=sys.stderr), **ort)
    modes = modes_for(budgets, args.branch_k, runner.backend.block_size, args.chain)
    if args.law_mode is not None and args.law_mode not in {m.name for m in modes if m.kind != "ar"}:
        raise GlanceError(f"--law-mode {args.law_mode} is not a measured mode; choose one of: "
                          + ", ".join(m.name for m in modes if m.kind != "ar"))
    for mode in modes:
        check_decode(runner.limits, mode.config(args.max_new_tokens))
    conditions = _conditions(runner, args, argv)
    clock = GraphClock.attach(runner.backend)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with Progress(len(tasks)) as progress:
        for task in tasks:
            result = measure_prompt(runner.backend, task, runner.build_prompt, runner.stop_ids, modes, args.samples,
                                    args.max_new_tokens, clock, args.seed_drafts)
            results.append(result)
            progress.step(f"{task.kind} {task.index}: {result.new_tokens} tokens")
    conditions.update(load_end=round(os.getloadavg()[0], 2), finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    settings = {"budgets": budgets, "branch_k": args.branch_k, "chain": args.chain, "samples": args.samples,
                "warmup_dropped": 1, "prompts": len(tasks), "n": args.n, "max_new_tokens": args.max_new_tokens,
                "drafts": "the head's own" if args.seed_drafts == "none" else f"seeded ({args.seed_drafts}; an upper bound)",
                "block_size": runner.backend.block_size, "bootstrap": args.bootstrap, "seed": args.seed,
                "modes": [m.name for m in modes], "data": [str(p) for p in args.data]}
    report, rows, fits = build(results, modes, conditions, settings, args.bootstrap, args.seed, args.law_mode)
    files = write(args.out, report, rows, fits, not args.no_plots)
    lossless = report["lossless"]
    if lossless["identical"] < lossless["runs"]:
        print(f"glance-bench: warning: {lossless['runs'] - lossless['identical']} of {lossless['runs']} runs differ "
              "from AR greedy (see identical counts in report.md)", file=sys.stderr)
    pooled = report["pooled"]
    best = pooled["modes"][pooled["best"]]
    print(f"best {pooled['best']}: {best['speedup_decode']:.2f}x excl. prefill, {best['speedup_with_prefill']:.2f}x "
          f"incl. (geomean of {len(report['kinds'])} kinds), tau {best['tau']:.2f}; law: {report['law']['pooled']['verdict']}")
    print(f"wrote {', '.join(files)} to {args.out}")
    return 0


def run_law(args: argparse.Namespace) -> int:
    from .rounds import read_rounds

    if args.bootstrap < 1:
        raise GlanceError("--bootstrap must be at least 1")
    rows = read_rounds(args.rounds)
    if not select(rows, args.mode, args.cap, args.include_final):
        raise GlanceError("no rounds left to fit (every round ended its answer); pass --include-final")
    fits = fit_log(rows, args.mode, args.cap, replicates=args.bootstrap, seed=args.seed,
                   include_final=args.include_final)
    dicts = {k: clean_json(f.as_dict()) for k, f in fits.items()}
    chosen = select(rows, args.mode, args.cap, args.include_final)
    mode = chosen[0].get("mode", "all rounds")
    if args.out:
        if args.out.exists() and not args.out.is_dir():
            raise GlanceError(f"--out {args.out} is a file; pass a directory")
        from .plots import plot_law

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "law.json").write_text(json.dumps({"mode": mode, "law": dicts}, indent=2) + "\n")
        (args.out / "law.md").write_text("\n".join([f"# Draftability law ({mode})", "", *law_table(dicts), ""]))
        plot_law(args.out / "law.png", fits, chosen, str(mode))
    if args.json:
        print(json.dumps({"mode": mode, "law": dicts}, indent=2))
    else:
        print(f"rounds of {mode}:")
        print("\n".join(law_table(dicts)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["law"]:
        return guarded("glance-bench", lambda: run_law(law_parser().parse_args(argv[1:])))
    return guarded("glance-bench", lambda: run_bench(bench_parser().parse_args(argv), argv))
