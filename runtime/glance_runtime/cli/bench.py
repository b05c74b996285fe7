"""`glance-bench`: AR, GLANCE trees, chains and `--budget auto` on one backend, interleaved per prompt, with
the law and plots; and the commands around auto: this device's cost profile and the calibration's refit.

    glance-bench --data examples/receipt/tasks.jsonl --data examples/chart/tasks.jsonl --out bench/ [--chain]
                 [--budgets 7,15,31,63,auto] [--calibration FILE] [--remeasure]
    glance-bench law bench/rounds.jsonl [--mode tree-63] [--out DIR]
    glance-bench cost [--artifacts DIR | --engines DIR | --model DIR --head DIR] [--threads N] [--remeasure]
    glance-bench calibrate bench/rounds.jsonl [--out calibration.json] [--mode tree-31,tree-63]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import textwrap
import time
from pathlib import Path

from .._version import __version__
from ..store.atomic import check_output, check_output_file, output_directory, output_format
from ..decode.auto_budget import AutoBudget, auto_budget
from ..decode.calibration import FILE as CALIBRATION_FILE, FORMAT as CALIBRATION_FORMAT, Calibration, load_calibration
from .flags import OneLineParser, at_least, check_dirs, guarded, runner_flags, sampling_flags, sampling_of, source
from ..defaults import BRANCH_K, MEASURE_MAX_NEW_TOKENS, resolve
from ..errors import GlanceError
from ..formats.cost import REMEDY
from ..decode.limits import check_decode
from ..decode.sampling import derived
from ..backends.registry import open_session
from ..decode.session import Session
from ..bench.calibrate import fit_calibration, summary_lines
from ..bench.expect import METRICS, line as expect_line, parse as parse_expect
from ..bench.law_log import fit_log, select
from ..bench.markdown import law_table
from ..bench.measure import measure_prompt
from ..bench.modes import auto_mode, modes_for, parse_budgets
from ..bench.progress import Progress
from ..bench.report import clean_json, build, write
from ..formats.rounds import read as read_rounds
from ..bench.round_rows import calibration_rows
from ..bench.task_prompts import read_bench_tasks

REPORT_FORMAT = "glance-bench-report"
LAW_FORMAT = "glance-bench-law"


def _runner_args(p: argparse.ArgumentParser) -> None:
    """What the bench and `cost` are run on: glance-run's flags, and the trees' top-k."""
    runner_flags(p)
    p.add_argument("--branch-k", type=at_least("--branch-k", 1), default=BRANCH_K,
                   help=f"top-k per draft offset for the trees (default {BRANCH_K})")
    p.add_argument("--remeasure", action="store_true", help="measure this device's cost profile for auto again, "
                   "even where one is stored")


def bench_parser() -> argparse.ArgumentParser:
    """The measurement's flags; its usage line and --help name the subcommands too, which main dispatches on
    the first argument before this parser sees it."""
    subcommands = {"law": law_parser, "cost": cost_parser, "calibrate": calibrate_parser}
    p = OneLineParser(prog="glance-bench",
                      usage="%(prog)s --data TASKS.jsonl [TASKS.jsonl ...] --out DIR [options]\n"
                            f"       %(prog)s {{{','.join(subcommands)}}} ...   (each answers --help)",
                      description="Speed, acceptance and the draftability law of GLANCE against AR greedy\n"
                                  "decoding, measured side by side.",
                      epilog="subcommands:\n" + "\n".join(
                          textwrap.fill(parser().description, 78, initial_indent=f"  {name:<11}",
                                        subsequent_indent=" " * 13) for name, parser in subcommands.items()),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, action="extend", nargs="+", required=True,
                   help="TASKS.jsonl (repeatable); a row's \"kind\", else the file's directory, names its task kind")
    p.add_argument("--out", type=Path, required=True, help="directory for report.json, report.md, rounds.jsonl, PNGs")
    _runner_args(p)
    p.add_argument("--budgets", default="7,15,31,63,auto", help="tree budgets, comma-separated, at least one fixed; "
                   "auto sizes each round's tree from the draft's confidence and this device's cost profile "
                   "(default 7,15,31,63,auto)")
    p.add_argument("--calibration", type=Path, help="calibration.json for auto (default: the one beside the "
                   "artifacts, engines or head, else the prior; refit one with `glance-bench calibrate`)")
    p.add_argument("--chain", action="store_true", help="also the same head as a chain (branch 1, min(budget, B-1) nodes)")
    p.add_argument("--n", type=int, help="first N prompts of each task file (default: all)")
    p.add_argument("--samples", type=int, default=3, help="runs per prompt and mode, the first dropped as a warm-up")
    p.add_argument("--max-new-tokens", type=at_least("--max-new-tokens", 2), default=MEASURE_MAX_NEW_TOKENS,
                   help=f"answer length per run (default {MEASURE_MAX_NEW_TOKENS}; at least 2: prefill gives the first)")
    p.add_argument("--seed-drafts", choices=("none", "partial", "full"), default="none",
                   help="seed the target's own greedy continuation into the draft top-k with confident log-probs "
                   "(an upper bound, for random heads): at every offset (full) or the first half (partial)")
    p.add_argument("--law-mode", help="whose rounds the law is fitted to (default: the largest tree budget)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates for intervals")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and permutation draws")
    sampling_flags(p, "--sampling-seed", 0, "the sampling seed with --temperature above 0 (default 0): prompt i of "
                   "the data samples with this seed + i, in every mode alike, so every mode must match AR")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    p.add_argument("--expect", action="append", default=[], metavar="METRIC[@KIND]OP NUMBER",
                   help="a threshold of your own, e.g. speedup>=1.5 or auto_vs_best<=1.05 (repeatable): each is "
                   "reported met or not, and glance-bench exits 1 when one is not; metrics: " + ", ".join(METRICS))
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
    p.add_argument("--no-plots", action="store_true", help="skip law.png (no matplotlib needed)")
    p.add_argument("--json", action="store_true", help="print the fits as JSON")
    return p


def cost_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-bench cost", description="This device's cost profile for --budget auto (a "
                                "verify pass against its tree rows, and a draft pass): printed with where it is "
                                "stored, measured first where none is.")
    _runner_args(p)
    return p


def calibrate_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="glance-bench calibrate", description="Refit --budget auto's calibration (node "
                                "acceptance from the draft's path scores and the anchor's surprisal; the law on "
                                "surprisal) from a glance-bench round log.")
    p.add_argument("rounds", type=Path, help="rounds.jsonl from glance-bench (this version: it logs node scores)")
    p.add_argument("--out", type=Path, help=f"file to write, or a directory for {CALIBRATION_FILE} (default: "
                   f"{CALIBRATION_FILE} beside the round log); auto reads it beside the artifacts, engines or head, "
                   "or from glance-bench --calibration")
    p.add_argument("--mode", help="comma-separated modes whose rounds to fit (default: every fixed tree, tree-N)")
    return p


def _open(args: argparse.Namespace) -> Session:
    model, head, artifacts, backend = resolve(args.model, args.head, args.artifacts, args.backend)
    return open_session(source(args, backend, model=model, head=head, artifacts=artifacts), progress=_progress)


def _progress(line: str) -> None:
    print(line, file=sys.stderr)


def _auto(session: Session, args: argparse.Namespace, calibration: Calibration | None) -> tuple[AutoBudget, dict]:
    """The session's auto policy (with `calibration`, from --calibration, in place of the one found) and what
    the report records of it: the cost profile with its path, and the calibration's path ("prior" where none)."""
    policy, cost_path, found = auto_budget(session, args.branch_k, remeasure=args.remeasure, progress=_progress)
    if calibration is not None:
        policy, found = policy.with_calibration(calibration), args.calibration
    return policy, {"max_nodes": policy.max_nodes, "cost_table": policy.cost.table(),
                    "cost_profile": {"path": str(cost_path), **policy.cost.as_dict()},
                    "calibration": {"path": str(found) if found else "prior",
                                    "fitted_on": policy.calibration.fitted_on}}


def _check(args: argparse.Namespace) -> None:
    if args.samples < 2:
        raise GlanceError("--samples must be at least 2 (the first is a dropped warm-up)")
    if args.n is not None and args.n < 1:
        raise GlanceError("--n must be at least 1")
    if args.bootstrap < 1:
        raise GlanceError("--bootstrap must be at least 1")
    check_dirs(args)
    check_output(args.out, REPORT_FORMAT, _inputs(args), whole=False)


def _inputs(args: argparse.Namespace) -> list[Path | None]:
    """What the bench reads: its --out may be none of these, nor hold one."""
    return [*args.data, args.model, args.head, args.artifacts, args.engines, args.calibration]


def _conditions(session: Session, args: argparse.Namespace, argv: list[str]) -> dict:
    providers = session.backend.info.providers
    versions = {}
    for module in ("numpy", "onnxruntime"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            continue
    return {"command": "glance-bench " + " ".join(shlex.quote(a) for a in argv), "toolkit": __version__,
            "backend": session.backend.name, "providers": ", ".join(providers) if providers else None,
            "threads": args.threads, "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions,
            "load_start": round(os.getloadavg()[0], 2), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    _check(args)
    sampling = sampling_of(args)
    budgets, with_auto = parse_budgets(args.budgets)
    if not with_auto and (args.calibration is not None or args.remeasure):
        raise GlanceError("--calibration and --remeasure are for the auto mode; add auto to --budgets")
    measured = {name for name, ran in (("auto", with_auto), ("chain", args.chain)) if ran}
    expectations = [parse_expect(e, measured) for e in args.expect]
    calibration = load_calibration(args.calibration) if args.calibration is not None else None
    tasks = read_bench_tasks(args.data, args.n)
    if not args.no_plots:
        from ..bench.plots import pyplot

        pyplot()
    session = _open(args)
    modes = modes_for(budgets, args.branch_k, session.backend.block_size, args.chain)
    if args.law_mode is not None and args.law_mode not in {m.name for m in modes if m.kind != "ar"}:
        raise GlanceError(f"--law-mode {args.law_mode} is not a fixed mode measured here; choose one of: "
                          + ", ".join(m.name for m in modes if m.kind != "ar"))
    for mode in modes:
        check_decode(session.limits, mode.config(args.max_new_tokens))
    auto = None
    if with_auto:
        policy, auto = _auto(session, args, calibration)
        modes.append(auto_mode(policy, args.branch_k))
    conditions = _conditions(session, args, argv)
    clock = session.backend.time_graphs()
    output_directory(args.out, REPORT_FORMAT, "glance-bench", _inputs(args))
    results = []
    with Progress(len(tasks)) as progress:
        for task in tasks:
            result = measure_prompt(session.backend, task, session.prompt, session.stop_ids, modes, args.samples,
                                    args.max_new_tokens, clock, args.seed_drafts, derived(sampling, len(results)))
            results.append(result)
            progress.step(f"{task.kind} {task.index}: {result.new_tokens} tokens")
    conditions.update(load_end=round(os.getloadavg()[0], 2), finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    settings = {"budgets": budgets, "auto": with_auto, "branch_k": args.branch_k, "chain": args.chain,
                "samples": args.samples,
                "warmup_dropped": 1, "prompts": len(tasks), "n": args.n, "max_new_tokens": args.max_new_tokens,
                "drafts": "the head's own" if args.seed_drafts == "none" else f"seeded ({args.seed_drafts}; an upper bound)",
                "block_size": session.backend.block_size, "bootstrap": args.bootstrap, "seed": args.seed,
                "sampling": None if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                                          "top_k": sampling.top_k, "min_p": sampling.min_p,
                                                          "seed": sampling.seed},
                "modes": [m.name for m in modes], "data": [str(p) for p in args.data]}
    report, rows, fits = build(results, modes, conditions, settings, args.bootstrap, args.seed, args.law_mode, auto,
                               expectations)
    files = write(args.out, report, rows, fits, not args.no_plots)
    lossless = report["lossless"]
    if lossless["identical"] < lossless["runs"]:
        print(f"glance-bench: warning: {lossless['runs'] - lossless['identical']} of {lossless['runs']} runs differ "
              f"from AR {'greedy' if sampling.greedy else 'sampling with the same seeds'} (see identical counts in "
              "report.md)", file=sys.stderr)
    pooled = report["pooled"]
    best = pooled["modes"][pooled["best"]]
    print(f"best {pooled['best']}: {best['speedup_decode']:.2f}x excl. prefill, {best['speedup_with_prefill']:.2f}x "
          f"incl. (geomean of {len(report['kinds'])} kinds), tau {best['tau']:.2f}; law: {report['law']['pooled']['verdict']}")
    if auto is not None:
        a = report["auto"]
        print(f"auto: ms/token {a['vs_best_fixed']['pooled']['ratio']:.2f}x the best fixed tree's, speedup "
              f"{a['vs_largest_tree']['pooled']['speedup']:.2f}x over {a['largest_tree']} (geomeans of kinds, excl. "
              f"prefill); no draft in {a['sizes']['pooled']['no_draft_share']:.0%} of rounds")
    print(f"wrote {', '.join(files)} to {args.out}")
    for result in report.get("expectations", []):
        print(expect_line(result))
    return 0 if all(r["met"] for r in report.get("expectations", [])) else 1


def run_law(args: argparse.Namespace) -> int:
    if args.bootstrap < 1:
        raise GlanceError("--bootstrap must be at least 1")
    if args.out:
        check_output(args.out, LAW_FORMAT, [args.rounds], whole=False)
    rows = read_rounds(args.rounds)
    if not select(rows, args.mode, args.cap, args.include_final):
        raise GlanceError("no rounds left to fit (every round ended its answer); pass --include-final")
    fits = fit_log(rows, args.mode, args.cap, replicates=args.bootstrap, seed=args.seed,
                   include_final=args.include_final)
    dicts = {k: clean_json(f.as_dict()) for k, f in fits.items()}
    chosen = select(rows, args.mode, args.cap, args.include_final)
    mode = chosen[0].get("mode", "all rounds")
    if args.out:
        from ..bench.plots import plot_law

        output_directory(args.out, LAW_FORMAT, "glance-bench law", [args.rounds])
        (args.out / "law.json").write_text(json.dumps({"mode": mode, "law": dicts}, indent=2) + "\n")
        (args.out / "law.md").write_text("\n".join([f"# Draftability law ({mode})", "", *law_table(dicts), ""]))
        if not args.no_plots:
            plot_law(args.out / "law.png", fits, chosen, str(mode))
    if args.json:
        print(json.dumps({"mode": mode, "law": dicts}, indent=2))
    else:
        print(f"rounds of {mode}:")
        print("\n".join(law_table(dicts)))
    return 0


def run_cost(args: argparse.Namespace) -> int:
    check_dirs(args)
    session = _open(args)
    policy, path, calibration = auto_budget(session, args.branch_k, remeasure=args.remeasure, progress=_progress)
    print(policy.cost.table())
    print(f"stored in {path}" if path is not None else "kept in memory for this run only (not stored)")
    problems = policy.cost.problems()
    for problem in problems:
        print(f"doubtful: {problem}")
    if problems:
        print(REMEDY)
    where = calibration or f"the prior (no {CALIBRATION_FILE} beside the artifacts, engines or head)"
    print(f"auto verifies at most {policy.max_nodes} nodes a round; calibration: {where}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    out = args.out or args.rounds.with_name(CALIBRATION_FILE)
    if out.is_dir():
        if output_format(out) is None:  # a folder of the user's: only a file named outright is written there
            raise GlanceError(f"--out {out} is a folder no glance command made; name the file to write "
                              f"(--out {out / CALIBRATION_FILE}) or pass the artifacts, engines or head directory")
        out = out / CALIBRATION_FILE
    check_output_file(out, CALIBRATION_FORMAT, [args.rounds])
    modes = [m.strip() for m in args.mode.split(",") if m.strip()] if args.mode else None
    rows = calibration_rows(read_rounds(args.rounds), modes, str(args.rounds))
    calibration, fit = fit_calibration(rows, source=f"{args.rounds} ({', '.join(sorted({r['mode'] for r in rows}))})")
    calibration.save(out)
    print("\n".join(summary_lines(calibration, fit)))
    print(f"wrote {out}")
    return 0


SUBCOMMANDS = {"law": lambda argv: run_law(law_parser().parse_args(argv)),
               "cost": lambda argv: run_cost(cost_parser().parse_args(argv)),
               "calibrate": lambda argv: run_calibrate(calibrate_parser().parse_args(argv))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return guarded("glance-bench", lambda: SUBCOMMANDS[argv[0]](argv[1:]))
    return guarded("glance-bench", lambda: run_bench(bench_parser().parse_args(argv), argv))
