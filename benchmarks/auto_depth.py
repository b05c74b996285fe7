"""`--budget auto` with the draft's cost by depth against auto drafting whole blocks, on seeded chains.

    python benchmarks/auto_depth.py OUT --artifacts ART [--threads 2] [--new-tokens 24] [--repeats 3]
        [--seeding partial|full] [--label NAME]

One process: ONNX Runtime on ART (graphs with short blocks, so a shallow draft runs the head over fewer rows),
drafts seeded from the graphs' own greedy continuation (`partial`: tau about half the block, `full`: the whole
block) so the loop's speed shows apart from a head's quality. A cost profile is measured first (verify rows and
draft depths); a calibration is fitted on seeded decodes of four other prompts at budget 7, as
`glance-bench calibrate` fits one. Then, interleaved repeat by repeat:
- auto-whole: auto with the same profile stripped of its draft depths (every drafting round drafts the block:
  what auto did before it weighed depth);
- auto-depth: auto with the profile as measured;
- fixed budgets 3 and 7, for reference.
Each reports ms per token (median over repeats, prefill excluded), tau and the draft depths auto asked for,
and whether its tokens equal the graphs' plain greedy decode (int4 graphs with int8 activations may choose
otherwise in a tree pass than in a one-row pass, so the seeds are what the seeded decode itself commits, as in
`int4_vs_genai.py`). Rows go to OUT/auto_depth.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT)]

from int4_vs_genai import seeded_truth  # noqa: E402  (beside this file)

PROMPT = "Describe the weather in a short poem, then list three colours and explain each one."
CALIBRATION_PROMPTS = ("Write a short note to a neighbour about a lost cat.", "List five fruits and their colours.",
                       "Explain in two sentences why the sky is blue.", "Give three tips for a job interview.")


def run(args) -> dict:
    from glance_runtime.backends.registry import Source, open_session
    from glance_runtime.bench.calibrate import fit_calibration
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.decode.auto_budget import AutoBudget
    from glance_runtime.decode.cost_profile import measure
    from glance_runtime.decode.loop import DecodeConfig, decode
    from glance_runtime.prompt.messages import user_turn

    session = open_session(Source("onnxruntime", artifacts=args.artifacts, threads=args.threads))
    backend = session.backend
    prompt = session.build([user_turn(PROMPT)])
    new = args.new_tokens
    greedy = decode(backend, prompt, DecodeConfig(max_new_tokens=new, speculative=False)).tokens
    seeds = seeded_truth(backend, prompt, greedy, args.seeding, 7, new)
    seeded = ConfidentSeeds(backend, seeds, prompt.length, args.seeding)
    print(f"[{args.label}] measuring the cost profile (load {os.getloadavg()[0]:.2f})", flush=True)
    cost = measure(backend, prompt, max_rows=64, branch_k=8, progress=lambda line: print("  " + line, flush=True))
    print(cost.table(), flush=True)
    rows = []
    for i, text in enumerate(CALIBRATION_PROMPTS):
        other = session.build([user_turn(text)])
        truth = decode(backend, other, DecodeConfig(max_new_tokens=new, speculative=False)).tokens
        truth = seeded_truth(backend, other, truth, args.seeding, 7, new)
        fixed = decode(ConfidentSeeds(backend, truth, other.length, args.seeding), other,
                       DecodeConfig(max_new_tokens=new, budget=7, branch_k=8))
        rows += [{"drafted": r.drafted, "node_scores": r.node_scores, "node_depths": r.node_depths, "path": r.path,
                  "surprisal": r.surprisal, "cap": min(7, backend.block_size - 1), "prompt": i, "mode": "b7"}
                 for r in fixed.rounds]
    calibration, _ = fit_calibration(rows, "seeded budget-7 rounds")
    whole = replace(cost, draft_depths=(), draft_share=())
    largest = min(63, cost.max_rows - 1)
    modes = {
        "auto-whole": lambda: DecodeConfig(max_new_tokens=new, budget=largest, branch_k=8,
                                           auto=AutoBudget(whole, calibration, largest, backend.block_size)),
        "auto-depth": lambda: DecodeConfig(max_new_tokens=new, budget=largest, branch_k=8,
                                           auto=AutoBudget(cost, calibration, largest, backend.block_size)),
        "b3": lambda: DecodeConfig(max_new_tokens=new, budget=3, branch_k=8),
        "b7": lambda: DecodeConfig(max_new_tokens=new, budget=7, branch_k=8),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    taus: dict[str, list[float]] = {m: [] for m in modes}
    depths: dict[str, Counter] = {m: Counter() for m in modes}
    same: dict[str, list[bool]] = {m: [] for m in modes}
    loads = []
    for repeat in range(args.repeats + 1):  # the first pass warms up
        loads.append(os.getloadavg()[0])
        for name in (list(modes) if repeat % 2 else list(modes)[::-1]):
            result = decode(seeded, prompt, modes[name]())
            if repeat:
                same[name].append(result.tokens == greedy)
                decode_ms = sum(r.total_ms for r in result.rounds)
                times[name].append(decode_ms / max(len(result.tokens) - 1, 1))
                taus[name].append(result.tau)
                depths[name].update(r.draft_depth for r in result.rounds if r.drafted)
        print(f"  repeat {repeat}: " + ", ".join(f"{m} {times[m][-1]:.2f}" for m in modes if times[m]), flush=True)
    out = {"label": args.label, "artifacts": str(args.artifacts), "threads": args.threads, "new_tokens": new,
           "seeding": args.seeding, "block_size": backend.block_size, "repeats": args.repeats,
           "load_before_repeats": [round(x, 2) for x in loads], "profile": cost.as_dict(),
           "calibration_law": calibration.law, "modes": {}}
    for name in modes:
        out["modes"][name] = {"ms_per_token": round(statistics.median(times[name]), 3),
                              "tau": round(statistics.median(taus[name]), 3),
                              "draft_depths": {str(d): c for d, c in sorted(depths[name].items())},
                              "tokens_equal_greedy": all(same[name])}
    whole_ms = out["modes"]["auto-whole"]["ms_per_token"]
    out["auto_depth_over_whole"] = round(out["modes"]["auto-depth"]["ms_per_token"] / whole_ms, 3)
    session.close()
    return out


def write(out_dir: Path, row: dict) -> None:
    path = out_dir / "auto_depth.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append(row)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| label | seeding | block | auto-whole ms (tau) | auto-depth ms (tau) | depth / whole | b3 ms | b7 ms | "
             "auto-depth's draft depths | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["modes"]
        lines.append(f"| {r['label']} | {r['seeding']} | {r['block_size']} | {m['auto-whole']['ms_per_token']} "
                     f"({m['auto-whole']['tau']}) | {m['auto-depth']['ms_per_token']} ({m['auto-depth']['tau']}) | "
                     f"{r['auto_depth_over_whole']} | {m['b3']['ms_per_token']} | {m['b7']['ms_per_token']} | "
                     f"{', '.join(f'{d}: {c}' for d, c in m['auto-depth']['draft_depths'].items())} | "
                     f"{max(r['load_before_repeats']):.2f} |")
    (out_dir / "auto_depth.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeding", choices=("partial", "full"), default="partial")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    row = run(args)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    write(args.out, row)
    print(json.dumps(row["modes"], indent=1))


if __name__ == "__main__":
    main()
