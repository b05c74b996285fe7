"""A lone sequence's decode speed on the unified graphs (one target and one draft graph with a batch axis, reading
their past from the KV pool) against the toolkit as it was before in-flight batching (commit 4236e9e).

Each toolkit runs from its own tree: the old one from a git worktree of 4236e9e (`--old`, made on first use with
`git worktree add`; this checkout's state is not touched), the new one from this checkout (`--new`). Each times its
own graphs: `--model default` uses each tree's shipped models/glance-vl-tiny-onnx (the example receipt and chart
tasks with their images as prompts); `--model wide` exports the snapshot and head under `--wide DIR` (made by
`python benchmarks/batch_decode.py make-wide DIR`; only DIR/snapshot and DIR/head are read) with each tree's own
exporter, int4 --accuracy exact --max-context 512 --max-tree 16, into `--work`/wide-old and wide-new.

Every run is a fresh process (`python benchmarks/lone_sequence.py time ...` with PYTHONPATH=<tree>:<tree>/runtime:
this file's runner code is written against the API both trees share) on ONNX Runtime CPU with `--threads`
intra-op threads (1 by default). Modes: `plain` (greedy steps, no speculation) and `glance-b3`, `-b7`, `-b15`
(GLANCE at budget 3, 7, 15, branch 8) with the drafts seeded from the target's own greedy continuation at depths
1..3 with confident log-probs (`glance_runtime.bench.seeding`'s seeding at depth 3: tau about 4, whatever the
head's block). Every decode makes exactly `--new-tokens` tokens (no stop ids) and must equal the tree's own
greedy answer. A run loads the graphs, decodes every prompt once untimed, then `--samples` times; its figure is
the median over samples of decode ms per token (prefill and its token left out, prompts pooled). The greedy
answers and their seeds are worked out once per tree by `python benchmarks/lone_sequence.py prepare ...`.

Runs alternate old/new (old, new, old, new, ...) mode by mode, `--pairs` pairs per mode; the one-minute load
average is recorded before each. The report gives each mode's medians, every pair's new/old ratio and their
median; the target is new within 3% of old (median ratio <= 1.03) at every mode.

    python benchmarks/lone_sequence.py run benchmarks/results/batch_weights --model default
    python benchmarks/lone_sequence.py run benchmarks/results/batch_weights --model wide --wide /tmp/wide-v4

Writes OUT/lone_sequence-MODEL.json and OUT/lone_sequence-MODEL.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(Path(__file__).resolve())  # the children run this file from the tree they time
BEFORE_BATCHING = "4236e9e"
SEED_DEPTH = 3  # seeded offsets a round accepts: tau 4
BRANCH_K = 8
WIDE_PROMPTS = ("Describe the picture in detail, then list every object you can see and its colour.",
                "Write a short story about a lighthouse keeper.")
DEFAULT_TASKS = ("receipt", "chart")  # each one's first task, image included
WIDE_EXPORT = ("--quantize", "int4", "--accuracy", "exact", "--max-context", "512", "--max-tree", "16")
TARGET_RATIO = 1.03


def modes(budgets: list[int]) -> list[str]:
    return ["plain", *(f"glance-b{b}" for b in budgets)]


def budget_of(mode: str) -> int:
    return 0 if mode == "plain" else int(mode.removeprefix("glance-b"))


# ---- the runner: imported only in a child, from the tree on its PYTHONPATH ----

def open_runner(artifacts: Path, threads: int, prompts_file: Path):
    """The backend of one tree and the prompts encoded by that tree's codec."""
    from glance_runtime.backends.ort_backend import OrtBackend
    from glance_runtime.prompt.codec import exported_codec

    backend = OrtBackend(artifacts, threads=threads)
    codec = exported_codec(backend.manifest)
    prompts = [codec.turn(p["text"], p.get("image")) for p in json.loads(prompts_file.read_text())]
    return backend, prompts


def seeded(backend, truth: list[int], prompt_len: int):
    """The target's own continuation seeded at depths 1..SEED_DEPTH with confident log-probs."""
    from glance_runtime.backends.seeded import SeededDrafter
    from glance_runtime.bench.seeding import ConfidentSeeds

    class Seeds(ConfidentSeeds):
        """ConfidentSeeds at a fixed depth, not one derived from the head's block size."""

        def __init__(self) -> None:
            SeededDrafter.__init__(self, backend, truth + [0] * 16, prompt_len,
                                   lambda d: 0 if d <= SEED_DEPTH else None)
            self.depth = SEED_DEPTH

    return Seeds()


def config(mode: str, new_tokens: int):
    from glance_runtime.decode.loop import DecodeConfig

    if mode == "plain":
        return DecodeConfig(max_new_tokens=new_tokens, budget=0, speculative=False)
    return DecodeConfig(max_new_tokens=new_tokens, budget=budget_of(mode), branch_k=BRANCH_K)


def prepare(args: argparse.Namespace) -> None:
    """Each prompt's greedy answer, and per GLANCE mode the continuation its seeded decode commits (iterated until
    it commits what it was seeded with, as int4_vs_genai.seeded_truth does)."""
    from glance_runtime.decode.loop import decode

    backend, prompts = open_runner(args.artifacts, args.threads, args.prompts)
    greedy = [decode(backend, p, config("plain", args.new_tokens)).tokens for p in prompts]
    out: dict = {"plain": greedy}
    for mode in modes(args.budgets)[1:]:
        seeds = []
        for prompt, truth in zip(prompts, greedy):
            for _ in range(8):
                made = decode(seeded(backend, truth, prompt.length), prompt, config(mode, args.new_tokens)).tokens
                if made == truth:
                    break
                truth = made
            seeds.append(truth)
        out[mode] = seeds
    args.out.write_text(json.dumps(out))


def time_mode(args: argparse.Namespace) -> None:
    """One mode in this process: a warm-up pass over the prompts, then `samples` timed ones; beside each sample's
    ms/token, the graphs' share of it (each graph's run time, read after prefill and at the end of each decode)."""
    import glance_runtime
    import onnxruntime
    from glance_runtime.decode.loop import decode

    started = time.perf_counter()
    backend, prompts = open_runner(args.artifacts, args.threads, args.prompts)
    load_s = time.perf_counter() - started
    clock = backend.time_graphs()
    truths = json.loads(args.truth.read_text())[args.mode]
    cfg = config(args.mode, args.new_tokens)
    samples, taus, splits = [], [], []
    for sample in range(args.samples + 1):
        decode_ms, tokens, rounds, accepted = 0.0, 0, 0, 0
        graph_ms: dict[str, float] = {}
        for prompt, truth in zip(prompts, truths):
            drafter = backend if args.mode == "plain" else seeded(backend, truth, prompt.length)
            readings: list[dict[str, float]] = []
            result = decode(drafter, prompt, cfg, on_commit=lambda _new, _reports: readings.append(clock.reading()))
            if result.tokens != truth:
                raise SystemExit(f"{args.mode}: the decode of {args.artifacts} differs from its greedy answer")
            decode_ms += result.total_ms - result.prefill_ms
            tokens += len(result.tokens) - 1
            rounds += len(result.rounds)
            accepted += sum(r.accepted for r in result.rounds)
            for name, ms in readings[-1].items():
                graph_ms[name] = graph_ms.get(name, 0.0) + ms - readings[0][name]
        if sample:  # the first pass warms up
            samples.append(decode_ms / tokens)
            taus.append(accepted / rounds)
            split = {name: ms / tokens for name, ms in graph_ms.items() if ms}
            splits.append({**split, "outside": decode_ms / tokens - sum(split.values())})
    middle = samples.index(statistics.median_low(samples))
    args.out.write_text(json.dumps({
        "ms_per_token": statistics.median(samples), "samples_ms": [round(s, 4) for s in samples],
        "split_ms_per_token": {name: round(ms, 4) for name, ms in splits[middle].items()},
        "tau": statistics.median(taus), "load_s": round(load_s, 2), "runtime": glance_runtime.__file__,
        "onnxruntime": onnxruntime.__version__, "tokens_per_sample": tokens}))


# ---- the driver: stdlib only, so no tree's packages are imported here ----

def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "runtime")])}


def child(tree: Path, *argv: str) -> None:
    """This file's runner (or a tree's exporter) in a fresh process against `tree`'s packages only."""
    done = subprocess.run([sys.executable, *argv], env=tree_env(tree), cwd=tree, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise SystemExit(f"{tree}: `{' '.join(argv[:3])} ...` failed: {tail[-1] if tail else done.returncode}")


def old_tree(path: Path) -> Path:
    """The worktree of the commit before in-flight batching, added where it is missing."""
    if not (path / "runtime" / "glance_runtime").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), BEFORE_BATCHING],
                       check=True, capture_output=True)
    return path


def commit_of(tree: Path) -> str:
    """The tree's commit, "+edits" where its packages differ from it (a run on work not yet committed)."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    edits = subprocess.run([*git, "status", "--porcelain", "--", "runtime", "glance_export"], capture_output=True,
                           text=True).stdout.strip()
    return head + "+edits" * bool(edits)


def artifacts_of(tree: Path, side: str, args: argparse.Namespace) -> Path:
    """The graphs `tree` times: its shipped default, or the wide snapshot and head exported by its own exporter."""
    if args.model == "default":
        return tree / "models" / "glance-vl-tiny-onnx"
    out = args.work / f"wide-{side}"
    if not (out / "manifest.json").exists():
        print(f"exporting the wide model with {tree} into {out}", flush=True)
        child(tree, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))", "onnx",
              "--model", str(args.wide / "snapshot"), "--head", str(args.wide / "head"), "--out", str(out),
              *WIDE_EXPORT)
    return out


def prompts_file(args: argparse.Namespace) -> Path:
    """The prompts both trees encode, as text and image paths."""
    if args.model == "default":
        prompts = []
        for kind in DEFAULT_TASKS:
            tasks = ROOT / "examples" / kind / "tasks.jsonl"
            task = json.loads(tasks.read_text().splitlines()[0])
            prompts.append({"text": task["prompt"], "image": str(tasks.parent / task["image"])})
    else:
        prompts = [{"text": text} for text in WIDE_PROMPTS]
    path = args.work / f"prompts-{args.model}.json"
    path.write_text(json.dumps(prompts))
    return path


def run(args: argparse.Namespace) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"old": old_tree(args.old), "new": args.new}
    prompts = prompts_file(args)
    arts = {side: artifacts_of(tree, side, args) for side, tree in trees.items()}
    common = ["--prompts", str(prompts), "--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
    truth = {}
    for side, tree in trees.items():
        truth[side] = args.work / f"truth-{args.model}-{side}.json"
        child(tree, RUNNER, "prepare", "--artifacts", str(arts[side]), *common, "--out", str(truth[side]),
              "--budgets", ",".join(map(str, args.budgets)))
    runs = []
    for mode in modes(args.budgets):
        for pair in range(args.pairs):
            for side, tree in trees.items():
                load = os.getloadavg()[0]
                result = args.work / f"run-{args.model}-{mode}-{pair}-{side}.json"
                child(tree, RUNNER, "time", "--artifacts", str(arts[side]), *common, "--truth", str(truth[side]),
                      "--mode", mode, "--samples", str(args.samples), "--out", str(result))
                runs.append({"mode": mode, "pair": pair, "side": side, "load_before": round(load, 2),
                             **json.loads(result.read_text())})
                print(f"{mode} pair {pair} {side}: {runs[-1]['ms_per_token']:.3f} ms/token, tau "
                      f"{runs[-1]['tau']:.2f} (load {load:.2f})", flush=True)
    greedy = {side: json.loads(path.read_text())["plain"] for side, path in truth.items()}
    report = {"model": args.model, "threads": args.threads, "new_tokens": args.new_tokens, "samples": args.samples,
              "pairs": args.pairs, "seed_depth": SEED_DEPTH, "branch_k": BRANCH_K,
              "trees": {side: {"path": str(tree), "commit": commit_of(tree), "artifacts": str(arts[side])}
                        for side, tree in trees.items()},
              "greedy_equal_old_new": greedy["old"] == greedy["new"], "cpus": os.cpu_count(),
              "summary": summarize(runs, modes(args.budgets)), "runs": runs}
    stem = args.out / f"lone_sequence-{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def summarize(runs: list[dict], names: list[str]) -> dict:
    """Per mode: each side's median ms/token, every pair's new/old ratio, their median and the 3% verdict."""
    out = {}
    for mode in names:
        ms = {side: {r["pair"]: r["ms_per_token"] for r in runs if r["mode"] == mode and r["side"] == side}
              for side in ("old", "new")}
        ratios = [ms["new"][p] / ms["old"][p] for p in sorted(ms["old"])]
        out[mode] = {"old_ms": round(statistics.median(ms["old"].values()), 3),
                     "new_ms": round(statistics.median(ms["new"].values()), 3),
                     "ratios": [round(r, 4) for r in ratios], "median_ratio": round(statistics.median(ratios), 4),
                     "tau": statistics.median(r["tau"] for r in runs if r["mode"] == mode),
                     "within_3pct": statistics.median(ratios) <= TARGET_RATIO,
                     "split_ms_per_token": {side: split_median([r["split_ms_per_token"] for r in runs
                                                                 if r["mode"] == mode and r["side"] == side])
                                            for side in ("old", "new")}}
    return out


def split_median(splits: list[dict[str, float]]) -> dict[str, float]:
    """Each part's median over a side's runs of one mode (graphs a side lacks read 0)."""
    names = sorted({name for split in splits for name in split})
    return {name: round(statistics.median(split.get(name, 0.0) for split in splits), 4) for name in names}


def markdown(report: dict) -> str:
    trees = report["trees"]
    lines = [f"# Lone sequence: unified graphs ({trees['new']['commit']}) vs before batching "
             f"({trees['old']['commit']}), {report['model']} model",
             "", f"ONNX Runtime CPU, {report['threads']} intra-op thread(s), {report['new_tokens']} new tokens a "
             f"prompt, median of {report['samples']} samples a run after one warm-up, {report['pairs']} old/new "
             f"process pairs a mode (alternating). Greedy answers equal old vs new: {report['greedy_equal_old_new']}.",
             "", "| mode | tau | old ms/token | new ms/token | new/old per pair | median new/old | within 3% |",
             "|---|---|---|---|---|---|---|"]
    for mode, row in report["summary"].items():
        lines.append(f"| {mode} | {row['tau']:.2f} | {row['old_ms']:.3f} | {row['new_ms']:.3f} | "
                     f"{', '.join(f'{r:.3f}' for r in row['ratios'])} | {row['median_ratio']:.3f} | "
                     f"{'PASS' if row['within_3pct'] else 'FAIL'} |")
    parts = sorted({name for row in report["summary"].values() for split in row["split_ms_per_token"].values()
                    for name in split} - {"outside"}) + ["outside"]
    lines += ["", "Where a token's time goes (ms/token, medians over a side's runs; `outside`: the runtime between "
              "graph runs):", "", f"| mode | side | {' | '.join(parts)} |", "|---|---|" + "---|" * len(parts)]
    for mode, row in report["summary"].items():
        for side, split in row["split_ms_per_token"].items():
            lines.append(f"| {mode} | {side} | {' | '.join(f'{split.get(p, 0.0):.3f}' for p in parts)} |")
    loads = [r["load_before"] for r in report["runs"]]
    lines += ["", f"Load average before the runs: {min(loads):.2f} to {max(loads):.2f} on {report['cpus']} CPUs.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    budgets = {"type": lambda s: [int(b) for b in s.split(",")], "default": [3, 7, 15],
               "help": "GLANCE budgets (comma-separated)"}
    r = sub.add_parser("run", help="export where needed, then time old and new in alternating processes")
    r.add_argument("out", type=Path)
    r.add_argument("--model", choices=("default", "wide"), default="default")
    r.add_argument("--wide", type=Path, default=Path("/tmp/wide"), help="make-wide's DIR (snapshot and head)")
    r.add_argument("--old", type=Path, default=Path("/tmp/pre-batch"), help=f"worktree of {BEFORE_BATCHING}")
    r.add_argument("--new", type=Path, default=ROOT, help="the tree with the unified graphs")
    r.add_argument("--work", type=Path, default=Path("/tmp/lone-sequence"), help="exports, prompts, raw runs")
    r.add_argument("--pairs", type=int, default=3)
    r.add_argument("--samples", type=int, default=3)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--new-tokens", type=int, default=64)
    r.add_argument("--budgets", **budgets)
    for name in ("prepare", "time"):  # the runner, in a child with one tree on its path
        c = sub.add_parser(name)
        c.add_argument("--artifacts", type=Path, required=True)
        c.add_argument("--prompts", type=Path, required=True)
        c.add_argument("--threads", type=int, required=True)
        c.add_argument("--new-tokens", type=int, required=True)
        c.add_argument("--out", type=Path, required=True)
        c.add_argument("--budgets", **budgets)
        c.add_argument("--truth", type=Path)
        c.add_argument("--mode")
        c.add_argument("--samples", type=int, default=3)
    args = ap.parse_args()
    {"run": run, "prepare": prepare, "time": time_mode}[args.command](args)


if __name__ == "__main__":
    main()
