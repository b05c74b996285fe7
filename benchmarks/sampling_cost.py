"""What sampling costs against greedy decoding: a plain step, and a seeded tau-4 round, on one export.

    python benchmarks/sampling_cost.py OUT --artifacts ART [--threads 2] [--new-tokens 24] [--repeats 5]
        [--settings "1.0,1,0;0.7,0.95,0;0.7,1,50"] [--label NAME]

One process, ONNX Runtime on ART (exported with the vocab graph's logits). Per sampling setting
(temperature, top_p, top_k), interleaved repeat by repeat:
- plain greedy steps against plain sampled steps (no draft): ms per token, prefill excluded;
- rounds of budget 3 with drafts seeded from each decode's own plain answer (`partial`: three drafted tokens
  accepted a round, tau 4; the sampled answer for the sampled decode), greedy against sampled: ms per round.
Every decode's tokens are compared with the plain decode's (`tokens as plain`: int4 graphs with int8
activations may choose otherwise in a tree pass than in a one-row pass, greedy or sampled, so the seeds are
what the seeded decode itself commits). Rows go to OUT/sampling_cost.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime")]

PROMPT = "Describe the weather in a short poem, then list three colours and explain each one."
SEED = 7


def _settings(text: str) -> list[tuple[float, float, int]]:
    out = []
    for part in text.split(";"):
        temperature, top_p, top_k = part.split(",")
        out.append((float(temperature), float(top_p), int(top_k)))
    return out


def _settled(backend, prompt, truth: list[int], cfg, seeding: str = "partial") -> list[int]:
    """The continuation to seed so that every round accepts the seeded depth: the plain decode's tokens, unless a
    tree pass chooses otherwise than a one-row pass (int4 graphs with int8 activations, near-flat random logits),
    then what the seeded decode itself commits, until it commits what it was seeded with."""
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.decode.loop import decode

    for _ in range(8):
        out = decode(ConfidentSeeds(backend, truth, prompt.length, seeding), prompt, cfg).tokens
        if out == truth[:len(out)]:
            break
        truth = out
    return truth


def run(args) -> dict:
    from glance_runtime.backends.registry import Source, open_session
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.decode.loop import DecodeConfig, decode
    from glance_runtime.decode.sampling import GREEDY, SamplingParams
    from glance_runtime.prompt.messages import user_turn

    session = open_session(Source("onnxruntime", artifacts=args.artifacts, threads=args.threads))
    backend = session.backend
    prompt = session.build([user_turn(PROMPT)])
    new = args.new_tokens
    rows = []
    for temperature, top_p, top_k in _settings(args.settings):
        sampled = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=SEED).check()
        plain = {name: decode(backend, prompt, DecodeConfig(max_new_tokens=new, speculative=False, sampling=s)).tokens
                 for name, s in (("greedy", GREEDY), ("sampled", sampled))}
        rounds = {name: DecodeConfig(max_new_tokens=new, budget=3, branch_k=8, sampling=s)
                  for name, s in (("greedy", GREEDY), ("sampled", sampled))}
        seeds = {name: _settled(backend, prompt, plain[name], rounds[name]) for name in rounds}
        configs = {
            "step-greedy": (backend, DecodeConfig(max_new_tokens=new, speculative=False), "greedy"),
            "step-sampled": (backend, DecodeConfig(max_new_tokens=new, speculative=False, sampling=sampled), "sampled"),
            "round-greedy": (ConfidentSeeds(backend, seeds["greedy"], prompt.length, "partial"), rounds["greedy"],
                             "greedy"),
            "round-sampled": (ConfidentSeeds(backend, seeds["sampled"], prompt.length, "partial"), rounds["sampled"],
                              "sampled"),
        }
        per_token: dict[str, list[float]] = {m: [] for m in configs}
        per_round: dict[str, list[float]] = {m: [] for m in configs}
        taus: dict[str, list[float]] = {m: [] for m in configs}
        same: dict[str, bool] = {m: True for m in configs}
        loads = []
        for repeat in range(args.repeats + 1):  # the first pass warms up
            loads.append(os.getloadavg()[0])
            for name in (list(configs) if repeat % 2 else list(configs)[::-1]):
                drafter, cfg, truth = configs[name]
                result = decode(drafter, prompt, cfg)
                same[name] = same[name] and result.tokens == plain[truth]
                if repeat:
                    decode_ms = result.total_ms - result.prefill_ms
                    per_token[name].append(decode_ms / max(len(result.tokens) - 1, 1))
                    per_round[name].append(decode_ms / max(len(result.rounds), 1))
                    taus[name].append(result.tau)
            print(f"[T {temperature:g}, top-p {top_p:g}, top-k {top_k}] repeat {repeat}: " + ", ".join(
                f"{m} {per_token[m][-1]:.2f}" for m in configs if per_token[m]), flush=True)
        med = {m: {"ms_per_token": round(statistics.median(per_token[m]), 3),
                   "ms_per_round": round(statistics.median(per_round[m]), 3),
                   "tau": round(statistics.median(taus[m]), 3), "tokens_as_plain": same[m]} for m in configs}
        rows.append({"label": args.label, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": SEED,
                     "threads": args.threads, "new_tokens": new, "repeats": args.repeats,
                     "load_before_repeats": [round(x, 2) for x in loads], "modes": med,
                     "step_sampled_over_greedy": round(med["step-sampled"]["ms_per_token"]
                                                       / med["step-greedy"]["ms_per_token"], 3),
                     "round_sampled_over_greedy": round(med["round-sampled"]["ms_per_round"]
                                                        / med["round-greedy"]["ms_per_round"], 3)})
    session.close()
    return {"artifacts": str(args.artifacts), "rows": rows}


def write(out_dir: Path, result: dict) -> None:
    path = out_dir / "sampling_cost.json"
    rows = (json.loads(path.read_text()) if path.exists() else []) + result["rows"]
    path.write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| label | T | top-p | top-k | step ms: greedy / sampled (ratio) | tau-4 round ms: greedy / sampled (ratio) "
             "| tau greedy / sampled | tokens as plain | load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["modes"]
        lines.append(f"| {r['label']} | {r['temperature']:g} | {r['top_p']:g} | {r['top_k']} | "
                     f"{m['step-greedy']['ms_per_token']} / {m['step-sampled']['ms_per_token']} "
                     f"({r['step_sampled_over_greedy']}) | {m['round-greedy']['ms_per_round']} / "
                     f"{m['round-sampled']['ms_per_round']} ({r['round_sampled_over_greedy']}) | "
                     f"{m['round-greedy']['tau']} / {m['round-sampled']['tau']} | "
                     f"{all(v['tokens_as_plain'] for v in m.values())} | {max(r['load_before_repeats']):.2f} |")
    (out_dir / "sampling_cost.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settings", default="1.0,1,0;0.7,0.95,0;0.7,1,50",
                        help="temperature,top_p,top_k per setting, ';'-separated")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = run(args)
    write(args.out, result)
    print(f"wrote {args.out / 'sampling_cost.md'} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
