"""Assemble and write the bench's outputs: report.json, report.md, rounds.jsonl and the plots."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .auto_summary import auto_section, calibration_curve
from .expect import Expectation, judge_all
from .law import LawFit
from .law_log import POOLED, fit_log, select
from .markdown import render
from .measure import PromptResult
from .modes import Mode
from ..formats.rounds import write as write_rounds
from .round_rows import round_rows
from .summary import summarize_kind, summarize_pooled, tree_vs_chain


def _law_mode(modes: list[Mode]) -> str:
    return max((m for m in modes if m.kind == "tree"), key=lambda m: m.budget).name


def build(results: list[PromptResult], modes: list[Mode], conditions: dict, settings: dict, replicates: int,
          seed: int, law_mode: str | None = None, auto: dict | None = None,
          expectations: list[Expectation] = ()) -> tuple[dict, list[dict], dict[str, LawFit]]:
    """The report's dict, the round log's rows and the law's fits (per kind and pooled). `auto`: what the
    auto mode ran with (cost profile, calibration), where it ran; `expectations`: the user's thresholds.

    The law is fitted per fixed mode only: auto's rounds that skip the draft accept nothing by choice."""
    rng = np.random.default_rng(seed)
    by_kind: dict[str, list[PromptResult]] = {}
    for r in results:
        by_kind.setdefault(r.task.kind, []).append(r)
    kinds = {k: summarize_kind(rs, modes, replicates, rng) for k, rs in by_kind.items()}
    pooled = summarize_pooled(by_kind, kinds, modes, replicates, rng)
    rows = round_rows(results)
    law_mode = law_mode or _law_mode(modes)
    fits = fit_log(rows, law_mode, replicates=replicates, seed=seed)
    report = {"conditions": conditions, "settings": settings, "kinds": kinds, "pooled": pooled,
              "tree_vs_chain": {**{k: tree_vs_chain(s, modes) for k, s in kinds.items()},
                                POOLED: tree_vs_chain(pooled, modes)},
              "lossless": {"runs": sum(len(r.runs) for r in results),
                           "identical": sum(run.identical for r in results for run in r.runs)},
              "law_mode": law_mode,
              "law": {k: f.as_dict() for k, f in fits.items()},
              "law_by_mode": {m.name: fit_log(rows, m.name, replicates=replicates, seed=seed)[POOLED].as_dict()
                              for m in modes if m.kind in ("tree", "chain")},
              "law_with_final_rounds": fit_log(rows, law_mode, replicates=replicates, seed=seed,
                                               include_final=True)[POOLED].as_dict(),
              "calibration_curve": calibration_curve(rows, modes)}
    if auto is not None:
        report["auto"] = auto_section(by_kind, kinds, modes, auto, replicates, rng)
    if expectations:
        report["expectations"] = judge_all(list(expectations), report)
    return report, rows, fits


def clean_json(value):
    """JSON without NaN (written as null), tuples as lists."""
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return clean_json(value.item())
    return value


def write(out: Path, report: dict, rows: list[dict], fits: dict[str, LawFit], plots: bool) -> list[str]:
    """Every output file; returns their names."""
    files = ["report.json", "report.md", "rounds.jsonl"]
    if plots:
        from .plots import plot_auto_sizes, plot_calibration, plot_law, plot_speedup, plot_verify_cost

        plot_law(out / "law.png", fits, select(rows, report["law_mode"], None), report["law_mode"])
        plot_speedup(out / "speedup.png", report)
        plot_verify_cost(out / "verify_cost.png", rows)
        files += ["law.png", "speedup.png", "verify_cost.png"]
        if "auto" in report:
            plot_auto_sizes(out / "auto_sizes.png", report["auto"]["sizes"])
            files.append("auto_sizes.png")
        if "bins" in report["calibration_curve"]:
            plot_calibration(out / "calibration.png", report["calibration_curve"])
            files.append("calibration.png")
    report["files"] = files
    write_rounds(out / "rounds.jsonl", rows)
    (out / "report.json").write_text(json.dumps(clean_json(report), indent=2) + "\n")
    (out / "report.md").write_text(render(report))
    return files
