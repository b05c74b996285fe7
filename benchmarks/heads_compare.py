"""GLANCE heads against EAGLE-3 heads on one runtime: the same target, budgets and prompts, ONNX Runtime CPU.

Two parts:
- default: the embedded default target with its shipped GLANCE head and an EAGLE-3 head (trained the same way;
  `--eagle3-head`). glance-bench runs both over the four example task kinds (held-out prompts) at the same budgets:
  tau per task kind, ms/token, speedup over AR, and whether every answer equals greedy. Beside it, the draft cost
  per round against tree depth: a GLANCE round is one head pass whose projections grow with depth; an EAGLE-3 round
  is one head pass per depth.
- wide: the published Qwen2.5-VL-3B configuration (2048 wide, 16 heads, 2 KV heads, 151,936 tokens, tied; text
  depth cut to `--wide-layers`, vision to 2 blocks; `benchmarks/real_width.py`'s) with a random GLANCE head and a
  random EAGLE-3 head, both drafting over the same 32,000-token vocabulary, drafts seeded with the target's own
  greedy continuation (confident, as a good head's would be). Draft cost per round against tree depth, and
  ms/token at one budget for each.

    python benchmarks/heads_compare.py OUT [--eagle3-head models/glance-vl-tiny-eagle3] [--samples 3]
        [--threads 1] [--budgets 7,15,31,63] [--wide-layers 4] [--skip-wide] [--skip-bench]

Writes OUT/heads_compare.json and OUT/heads_compare.md (the tables), and the glance-bench reports under OUT/bench-*.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

DEFAULT_MODEL = ROOT / "models" / "glance-vl-tiny"
GLANCE_ARTIFACTS = ROOT / "models" / "glance-vl-tiny-onnx"
TASKS = [ROOT / "examples" / kind / "tasks.jsonl" for kind in ("receipt", "chart", "scene", "caption")]
DEPTHS = range(1, 8)
DRAFT_VOCAB = 32000  # the wide heads' draft vocabulary: the target's first 32,000 ids


def log(line: str) -> None:
    print(f"[heads] {line}", file=sys.stderr, flush=True)


def export(model: Path, head: Path, out: Path, **kw) -> Path:
    from glance_export.onnx import export_artifacts

    if (out / "manifest.json").exists():
        return out
    t0 = time.perf_counter()
    export_artifacts(model, head, out, progress=lambda line: log(f"export {out.name}: {line}"), **kw)
    log(f"exported {out.name} in {time.perf_counter() - t0:.0f} s")
    return out


def bench(artifacts: Path, out: Path, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    """glance-bench on one export, its cost profile in a fresh cache; returns report.json."""
    if not (out / "report.json").exists():
        cmd = [str(Path(sys.executable).parent / "glance-bench"), "--artifacts", str(artifacts),
               "--data", *map(str, TASKS), "--budgets", args.budgets, "--samples", str(args.samples),
               "--threads", str(args.threads), "--no-plots", "--out", str(out), *extra]
        if args.n:
            cmd += ["--n", str(args.n)]
        log(" ".join(["glance-bench", *cmd[1:]]))
        env = {**os.environ, "GLANCE_CACHE": tempfile.mkdtemp(prefix="heads-cache-")}
        subprocess.run(cmd, check=True, env=env)
    return json.loads((out / "report.json").read_text())


def summary(report: dict) -> dict:
    """Per task kind and pooled: tau and decode ms/token of each mode, AR's, and the lossless count."""
    keep = ("tau", "ms_per_token_decode", "speedup_decode", "draft_ms", "verify_ms", "round_ms", "mean_tree_size")

    def modes(block: dict) -> dict:
        return {name: {k: round(m[k], 4) for k in keep if m.get(k) is not None} for name, m in block["modes"].items()}

    return {"kinds": {kind: modes(block) for kind, block in report["kinds"].items()},
            "pooled": modes(report["pooled"]), "lossless": report["lossless"]}


def draft_costs(artifacts: Path, threads: int, rounds: int, seeded: bool) -> dict[int, float]:
    """Median ms of one round's drafting at each depth: a GLANCE draft of `depth` offsets, or an EAGLE-3 tree grown
    `depth` deep (budget 63, top-8). Each timed draft is followed by a one-row verify and commit, so every round
    starts from one new committed row, as a decode's rounds do."""
    import numpy as np

    from glance_runtime.backends.ort_backend import OrtBackend
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.bench.task_prompts import read_bench_tasks
    from glance_runtime.decode.backend import STEP_DRAFTERS
    from glance_runtime.decode.dynamic_tree import grow_dynamic
    from glance_runtime.decode.loop import DecodeConfig, decode
    from glance_runtime.prompt.codec import exported_codec

    backend = OrtBackend(artifacts, threads=threads)
    task = read_bench_tasks([TASKS[0]], 1)[0]
    prompt = exported_codec(backend.manifest).turn(task.prompt, task.image)
    drafter = backend
    if seeded:
        truth = decode(backend, prompt, DecodeConfig(max_new_tokens=rounds + 16, speculative=False)).tokens
        drafter = ConfidentSeeds(backend, truth, prompt.length, "full")
    steps = backend.info.limits.drafter in STEP_DRAFTERS
    costs = {}
    for depth in DEPTHS:
        anchor = backend.prefill(prompt).first
        times = []
        for r in range(rounds + 2):
            t0 = time.perf_counter()
            if steps:
                grow_dynamic(anchor, drafter, 63, 8, depth)
            else:
                drafter.draft(anchor, 8, depth)
            elapsed = (time.perf_counter() - t0) * 1e3
            argmax = backend.verify(np.array([anchor]), np.zeros(1, np.int64), np.ones((1, 1), bool)).argmax
            backend.commit(np.zeros(1, np.int64))
            anchor = int(argmax[0])
            if r >= 2:  # two warm-up rounds
                times.append(elapsed)
        costs[depth] = round(statistics.median(times), 3)
        log(f"{artifacts.name}: depth {depth}: {costs[depth]} ms")
    backend.close()
    return costs


def part_default(out: Path, args: argparse.Namespace) -> dict:
    eagle3 = export(DEFAULT_MODEL, Path(args.eagle3_head), out / "default-eagle3-onnx")
    result = {"eagle3_head": str(args.eagle3_head), "draft_ms_by_depth": {
        "glance": draft_costs(GLANCE_ARTIFACTS, args.threads, args.rounds, seeded=False),
        "eagle3": draft_costs(eagle3, args.threads, args.rounds, seeded=False)}}
    if not args.skip_bench:
        result["bench"] = {"glance": summary(bench(GLANCE_ARTIFACTS, out / "bench-default-glance", args)),
                           "eagle3": summary(bench(eagle3, out / "bench-default-eagle3", args))}
    return result


def part_wide(out: Path, args: argparse.Namespace) -> dict:
    from dataclasses import replace

    import torch

    from glance_export.model.adapters import Snapshot
    from glance_export.model.eagle3 import eagle3_config_for, init_eagle3, save_eagle3
    from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
    from real_width import PUBLISHED, cut
    from support import make_wide_snapshot

    published = PUBLISHED["qwen2.5-vl-3b"]
    text, vision = cut(published, args.wide_layers, 2)
    snap = out / "wide-snapshot"
    if not (snap / "config.json").exists():
        make_wide_snapshot(snap, published["family"], text, vision, tied=True)
    snapshot = Snapshot(snap)
    heads = {"glance": out / "wide-glance-head", "eagle3": out / "wide-eagle3-head"}
    if not heads["glance"].exists():  # both heads draft over the same 32,000 ids, so their projections cost alike
        cfg = replace(head_config_for(snapshot, 1, 16, pick_mask_token(snapshot)), draft_vocab_size=DRAFT_VOCAB)
        glance = init_head(cfg, seed=0)
        glance.draft_vocab_ids.copy_(torch.arange(DRAFT_VOCAB))
        save_head(glance, heads["glance"])
    if not heads["eagle3"].exists():
        save_eagle3(init_eagle3(eagle3_config_for(snapshot, draft_vocab_size=DRAFT_VOCAB), seed=0), heads["eagle3"])
    result = {"text_config": text, "draft_ms_by_depth": {}, "bench": {}}
    for kind, head in heads.items():
        artifacts = export(snap, head, out / f"wide-{kind}-onnx", max_tree=64, max_context=512)
        result["draft_ms_by_depth"][kind] = draft_costs(artifacts, args.threads, args.rounds, seeded=True)
        if not args.skip_bench:
            wide_args = argparse.Namespace(**{**vars(args), "budgets": args.wide_budget, "n": 2})
            report = bench(artifacts, out / f"bench-wide-{kind}", wide_args,
                           ("--seed-drafts", "full", "--max-new-tokens", "24"))
            result["bench"][kind] = summary(report)
    return result


def markdown(result: dict) -> str:
    lines = ["# GLANCE and EAGLE-3 heads on one runtime (ONNX Runtime CPU)", "",
             f"Command: `{result['command']}`; {result['cpus']} CPUs, threads {result['threads']}.", ""]
    for part in ("default", "wide"):
        if part not in result:
            continue
        data = result[part]
        lines += [f"## {part}", "", "Draft ms per round against tree depth (median):", "",
                  "| depth | " + " | ".join(data["draft_ms_by_depth"]) + " |",
                  "|---|" + "---|" * len(data["draft_ms_by_depth"])]
        for depth in DEPTHS:
            lines.append(f"| {depth} | " + " | ".join(str(costs[depth] if depth in costs else costs[str(depth)])
                                                      for costs in data["draft_ms_by_depth"].values()) + " |")
        for kind, bench_summary in data.get("bench", {}).items():
            lossless = bench_summary["lossless"]
            lines += ["", f"### {kind} head: tau, decode ms/token and speedup over AR per task kind; pooled tau, draft "
                      f"and verify ms per round (every answer identical to AR's: {lossless['identical']} of "
                      f"{lossless['runs']} runs)", ""]
            modes = list(bench_summary["pooled"])
            lines += ["| task | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
            for task, block in bench_summary["kinds"].items():
                lines.append(f"| {task} | " + " | ".join(
                    f"{block[m]['tau']:.2f}, {block[m]['ms_per_token_decode']:.3f} ms, "
                    f"{block[m].get('speedup_decode', 1.0):.2f}x" if m in block else "-" for m in modes) + " |")
            pooled = bench_summary["pooled"]
            lines.append("| pooled | " + " | ".join(
                f"{pooled[m]['tau']:.2f}, {pooled[m].get('speedup_decode', 1.0):.2f}x; "
                f"draft {pooled[m]['draft_ms']:.2f}, verify {pooled[m]['verify_ms']:.2f}" for m in modes) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--eagle3-head", default=str(ROOT / "models" / "glance-vl-tiny-eagle3"))
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budgets", default="7,15,31,63")
    parser.add_argument("--n", type=int, default=None, help="first N prompts of each task kind")
    parser.add_argument("--rounds", type=int, default=15, help="timed draft rounds per depth")
    parser.add_argument("--wide-layers", type=int, default=4)
    parser.add_argument("--wide-budget", default="15")
    parser.add_argument("--skip-wide", action="store_true")
    parser.add_argument("--skip-default", action="store_true")
    parser.add_argument("--skip-bench", action="store_true", help="draft costs only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": "python benchmarks/heads_compare.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
              "threads": args.threads, "load_start": os.getloadavg()[0]}
    if not args.skip_default:
        result["default"] = part_default(args.out, args)
    if not args.skip_wide:
        result["wide"] = part_wide(args.out, args)
    result["load_end"] = os.getloadavg()[0]
    (args.out / "heads_compare.json").write_text(json.dumps(result, indent=2))
    (args.out / "heads_compare.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
