"""From kept runs to the numbers the report states: per kind and pooled, per mode.

Reporting conventions: ms/token is a ratio of sums over prompts (each prompt's
median kept run), tau pools rounds, speedup = AR ms/token over the mode's, both from the same prompts
(so the bootstrap resamples prompts and keeps the pairing), kinds combine by geometric mean. Every
figure comes with and without prefill.
"""
from __future__ import annotations

from statistics import median

import numpy as np

from .measure import PromptResult
from .modes import Mode
from .stats import bootstrap, geomean, interval
from ..backends.graph_clock import GRAPH_NAMES


def _per_prompt(results: list[PromptResult], mode: str) -> dict[str, np.ndarray]:
    """Per prompt: median decode ms and total ms over kept runs, and token counts."""
    cols: dict[str, list] = {"decode_ms": [], "total_ms": [], "decode_tokens": [], "tokens": [], "prefill_ms": []}
    for r in results:
        runs = r.of(mode)
        cols["decode_ms"].append(median(x.decode_ms for x in runs))
        cols["total_ms"].append(median(x.total_ms for x in runs))
        cols["prefill_ms"].append(median(x.prefill_ms for x in runs))
        cols["decode_tokens"].append(runs[0].decode_tokens)
        cols["tokens"].append(runs[0].tokens)
    return {k: np.asarray(v, dtype=float) for k, v in cols.items()}


def _ms_per_token(cols: dict[str, np.ndarray], idx: np.ndarray, prefill: bool) -> float:
    ms, tokens = (cols["total_ms"], cols["tokens"]) if prefill else (cols["decode_ms"], cols["decode_tokens"])
    total = tokens[idx].sum()
    return float(ms[idx].sum() / total) if total else float("nan")


def paired_ratio(results: list[PromptResult], numerator: str, denominator: str, prefill: bool, replicates: int,
                 rng: np.random.Generator) -> tuple[float, tuple[float, float]]:
    """`numerator`'s ms/token over `denominator`'s on the same prompts (a speedup of the denominator), with a
    paired bootstrap 95% interval: each replicate resamples prompts and keeps both modes' runs of each."""
    top, bottom = _per_prompt(results, numerator), _per_prompt(results, denominator)

    def ratio(idx: np.ndarray) -> float:
        return _ms_per_token(top, idx, prefill) / _ms_per_token(bottom, idx, prefill)

    return ratio(np.arange(len(results))), interval(bootstrap(ratio, len(results), replicates, rng))


def _round_costs(results: list[PromptResult], mode: str) -> dict:
    """Pooled rounds of one mode: tau, tree size, per-round ms split into graphs and the outside."""
    rounds = [rd for r in results for run in r.of(mode) for rd in run.rounds]
    runs = [run for r in results for run in r.of(mode)]
    if not rounds:  # every answer ended at prefill's token
        nan = float("nan")
        return {"rounds": 0, "cost_source": "none", **{k: nan for k in (
            "tau", "tokens_per_round", "mean_tree_size", "round_ms", "draft_ms", "verify_ms", "outside_ms",
            "cost_ms", "outside_share")}}
    out = {"rounds": len(rounds), "tau": sum(rd["accepted"] for rd in rounds) / len(rounds),
           "tokens_per_round": sum(run.decode_tokens for run in runs) / len(rounds),
           "mean_tree_size": float(np.mean([rd["tree_size"] for rd in rounds])),
           "round_ms": float(np.mean([rd["total_ms"] for rd in rounds])),
           "draft_ms": float(np.mean([rd["draft_ms"] for rd in rounds])),
           "verify_ms": float(np.mean([rd["verify_ms"] for rd in rounds])),
           "outside_ms": float(np.mean([rd["outside_ms"] for rd in rounds]))}
    timed = all(f"{GRAPH_NAMES[0]}_graph_ms" in rd for rd in rounds)
    if timed:
        for name in GRAPH_NAMES:
            out[f"{name}_graph_ms"] = float(np.mean([rd[f"{name}_graph_ms"] for rd in rounds]))
    # The model's cost per round: the graphs' own time where timed, else the loop's draft + verify time.
    out["cost_ms"] = (sum(out[f"{n}_graph_ms"] for n in GRAPH_NAMES) if timed else out["draft_ms"] + out["verify_ms"])
    out["cost_source"] = "graph runs" if timed else "draft + verify calls"
    out["outside_share"] = out["outside_ms"] / out["round_ms"] if out["round_ms"] > 0 else float("nan")
    return out


def _efficiency(mode_costs: dict, ar_costs: dict, achieved: float) -> dict:
    """Ideal speedup: AR's model cost per token over this mode's model cost per committed token, i.e.
    what the measured acceptance would give with no time spent outside the graphs."""
    per_token = mode_costs["cost_ms"] / mode_costs["tokens_per_round"] if mode_costs["tokens_per_round"] else float("nan")
    ar_per_token = ar_costs["cost_ms"] / ar_costs["tokens_per_round"] if ar_costs["tokens_per_round"] else float("nan")
    ideal = ar_per_token / per_token if per_token else float("nan")
    return {"ideal_speedup": ideal, "achieved_fraction": achieved / ideal if ideal else float("nan")}


def summarize_kind(results: list[PromptResult], modes: list[Mode], replicates: int, rng: np.random.Generator) -> dict:
    """Every mode on one kind's prompts; speedup intervals from a paired bootstrap over prompts."""
    n = len(results)
    ar_costs = _round_costs(results, "ar")
    out: dict = {"prompts": n, "modes": {}}
    for m in modes:
        c = _per_prompt(results, m.name)
        entry = {"kind": m.kind, "budget": m.budget, "branch_k": m.branch_k,
                 "runs": sum(len(r.of(m.name)) for r in results),
                 "identical": sum(run.identical for r in results for run in r.of(m.name)),
                 "prefill_ms": float(np.median(c["prefill_ms"])),
                 **_round_costs(results, m.name)}
        for prefill, key in ((False, "decode"), (True, "with_prefill")):
            entry[f"ms_per_token_{key}"] = _ms_per_token(c, np.arange(n), prefill)
            if m.kind != "ar":
                entry[f"speedup_{key}"], entry[f"speedup_{key}_interval"] = paired_ratio(
                    results, "ar", m.name, prefill, replicates, rng)
        if m.kind != "ar":
            entry.update(_efficiency(entry, ar_costs, entry["speedup_decode"]))
        out["modes"][m.name] = entry
    spec = [m.name for m in modes if m.kind != "ar"]
    out["best"] = max(spec, key=lambda name: out["modes"][name]["speedup_decode"])
    return out


def summarize_pooled(by_kind: dict[str, list[PromptResult]], kinds: dict[str, dict], modes: list[Mode],
                     replicates: int, rng: np.random.Generator) -> dict:
    """Across kinds: speedups by geometric mean (bootstrap resamples prompts within every kind), tau and
    costs pooled over all rounds."""
    everything = [r for rs in by_kind.values() for r in rs]
    ar_costs = _round_costs(everything, "ar")
    cols = {kind: {m.name: _per_prompt(rs, m.name) for m in modes} for kind, rs in by_kind.items()}
    out: dict = {"kinds": len(by_kind), "prompts": len(everything), "modes": {}}
    for m in modes:
        entry = {"kind": m.kind, "budget": m.budget, "branch_k": m.branch_k, **_round_costs(everything, m.name)}
        if m.kind != "ar":
            for prefill, key in ((False, "decode"), (True, "with_prefill")):
                entry[f"speedup_{key}"] = geomean([kinds[k]["modes"][m.name][f"speedup_{key}"] for k in by_kind])
                reps = []
                for _ in range(replicates):
                    per_kind = []
                    for kind, c in cols.items():
                        idx = rng.integers(0, len(by_kind[kind]), len(by_kind[kind]))
                        per_kind.append(_ms_per_token(c["ar"], idx, prefill) / _ms_per_token(c[m.name], idx, prefill))
                    reps.append(geomean(per_kind))
                entry[f"speedup_{key}_interval"] = interval(reps)
            entry.update(_efficiency(entry, ar_costs, entry["speedup_decode"]))
        out["modes"][m.name] = entry
    spec = [m.name for m in modes if m.kind != "ar"]
    out["best"] = max(spec, key=lambda name: out["modes"][name]["speedup_decode"])
    return out


def tree_vs_chain(section: dict, modes: list[Mode]) -> dict[str, float]:
    """tau of the tree over tau of the chain at equal rows verified (budgets both modes ran)."""
    names = {m.name for m in modes}
    out = {}
    for m in modes:
        if m.kind == "chain" and f"tree-{m.budget}" in names:
            tree, chain = section["modes"][f"tree-{m.budget}"]["tau"], section["modes"][m.name]["tau"]
            out[str(m.budget)] = tree / chain if chain else float("nan")
    return out
