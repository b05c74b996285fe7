"""auto's part of the report: the tree sizes it chose, how often it skipped the draft, its speed against the
fixed trees, and the calibration curve refitted on the same run's fixed trees."""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..decode.auto_budget import AUTO
from ..errors import GlanceError
from .calibrate import fit_calibration, judged, summary_lines
from .law_log import POOLED
from .measure import PromptResult
from .modes import Mode
from .round_rows import calibration_rows
from .stats import geomean
from .summary import paired_ratio

def chosen_sizes(rounds: list[dict]) -> dict:
    """auto's rounds by what they verified: no draft (a plain greedy step), else the nodes kept besides the
    anchor (0: drafted, then every node cut), and how deep the drafts went (where the rounds record it)."""
    kept = [rd["tree_size"] - 1 for rd in rounds if rd["drafted"]]
    depths = [rd["draft_depth"] for rd in rounds if rd["drafted"] and rd.get("draft_depth") is not None]
    skipped = len(rounds) - len(kept)
    return {"rounds": len(rounds), "no_draft": skipped,
            "no_draft_share": skipped / len(rounds) if rounds else float("nan"),
            "mean_nodes_when_drafted": float(np.mean(kept)) if kept else float("nan"),
            "nodes": {str(n): count for n, count in sorted(Counter(kept).items())},
            "draft_depths": {str(d): count for d, count in sorted(Counter(depths).items())}}


def _rounds(results: list[PromptResult]) -> list[dict]:
    return [rd for r in results for run in r.of(AUTO) for rd in run.rounds]


def auto_section(by_kind: dict[str, list[PromptResult]], kinds: dict[str, dict], modes: list[Mode], setup: dict,
                 replicates: int, rng: np.random.Generator) -> dict:
    """`setup` (cost profile, calibration) with, per kind and pooled (geomean), the chosen sizes, auto's
    ms/token over the kind's best fixed tree's and its speedup over the largest tree,
    both excluding prefill with paired bootstrap intervals over prompts."""
    trees = [m for m in modes if m.kind == "tree"]
    largest = max(trees, key=lambda m: m.budget).name
    sizes, best, over = {}, {}, {}
    for kind, results in by_kind.items():
        sizes[kind] = chosen_sizes(_rounds(results))
        name = max((m.name for m in trees), key=lambda n: kinds[kind]["modes"][n]["speedup_decode"])
        ratio, ci = paired_ratio(results, AUTO, name, False, replicates, rng)
        best[kind] = {"best": name, "ratio": ratio, "interval": ci}
        speedup, ci = paired_ratio(results, largest, AUTO, False, replicates, rng)
        over[kind] = {"speedup": speedup, "interval": ci}
    sizes[POOLED] = chosen_sizes([rd for results in by_kind.values() for rd in _rounds(results)])
    best[POOLED] = {"ratio": geomean([v["ratio"] for v in best.values()])}
    over[POOLED] = {"speedup": geomean([v["speedup"] for v in over.values()])}
    return {**setup, "sizes": sizes, "vs_best_fixed": best, "largest_tree": largest, "vs_largest_tree": over}


PRIOR_NAME = "no data: the draft's own probabilities (the prior)"


def calibration_curve(rows: list[dict], modes: list[Mode]) -> dict:
    """Node acceptance predicted against observed on this run's fixed trees: by the calibration auto ran with
    (fitted elsewhere: the honest test), by one refitted on these rounds, and by the draft's own
    probabilities; where the run is too small to fit, why."""
    names = [m.name for m in modes if m.kind == "tree"]
    fixed = calibration_rows(rows, names, "the round log")
    used = next((m.policy.calibration for m in modes if m.policy is not None), None)
    out: dict = {"modes": names}
    if used is not None:
        source = used.fitted_on.get("source") or "another run" if used.fitted else PRIOR_NAME
        out["used"] = {"fitted_on": source, **judged(used, fixed)}
    try:
        calibration, fit = fit_calibration(fixed, source="glance-bench fixed trees: " + ", ".join(names))
    except GlanceError as exc:
        return {**out, "error": str(exc)}
    return {**out, "summary": summary_lines(calibration, fit), "calibration": calibration.as_dict(), **fit}
