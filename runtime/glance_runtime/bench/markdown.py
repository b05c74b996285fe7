"""report.md: the report's numbers as tables a reader scans, each stating what it includes."""
from __future__ import annotations

import math

from .expect import line as expect_line


def _f(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _p(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _ci(pair) -> str:
    return f"[{_f(pair[0])}, {_f(pair[1])}]"


def _speed_table(report: dict) -> list[str]:
    lines = ["| kind | mode | tau | ms/token excl. prefill | ms/token incl. | speedup excl. prefill [95%] | "
             "speedup incl. prefill [95%] | identical to AR |", "|---|---|---|---|---|---|---|---|"]
    for kind, section in report["kinds"].items():
        for name, e in section["modes"].items():
            best = " **best**" if name == section["best"] else ""
            speed = (f"{_f(e['speedup_decode'])}x {_ci(e['speedup_decode_interval'])}{best}",
                     f"{_f(e['speedup_with_prefill'])}x {_ci(e['speedup_with_prefill_interval'])}") \
                if e["kind"] != "ar" else ("1 (baseline)", "1 (baseline)")
            lines.append(f"| {kind} | {name} | {_f(e['tau'])} | {_f(e['ms_per_token_decode'], 3)} | "
                         f"{_f(e['ms_per_token_with_prefill'], 3)} | {speed[0]} | {speed[1]} | "
                         f"{e['identical']}/{e['runs']} |")
    pooled = report["pooled"]
    for name, e in pooled["modes"].items():
        if e["kind"] == "ar":
            continue
        best = " **best**" if name == pooled["best"] else ""
        lines.append(f"| geomean of kinds | {name} | {_f(e['tau'])} (pooled rounds) | | | "
                     f"{_f(e['speedup_decode'])}x {_ci(e['speedup_decode_interval'])}{best} | "
                     f"{_f(e['speedup_with_prefill'])}x {_ci(e['speedup_with_prefill_interval'])} | |")
    return lines


def _efficiency_table(report: dict) -> list[str]:
    modes = report["pooled"]["modes"]
    names = ["target", "draft", "vocab"] + (["draft_vocab"] if any(e.get("draft_vocab_graph_ms") for e in modes.values())
                                            else [])
    lines = [f"| mode | tau | tokens/round | rows | {' | '.join(names)} | outside | outside share | ideal speedup | "
             "achieved | achieved / ideal |", "|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|"]
    for name, e in modes.items():
        graphs = [_f(e.get(f"{g}_graph_ms"), 3) for g in names]
        tail = (f"{_f(e['ideal_speedup'])}x | {_f(e['speedup_decode'])}x | {_f(e['achieved_fraction'])}"
                if e["kind"] != "ar" else "1 | 1 | n/a")
        lines.append(f"| {name} | {_f(e['tau'])} | {_f(e['tokens_per_round'])} | {_f(e['mean_tree_size'], 1)} | "
                     f"{' | '.join(graphs)} | {_f(e['outside_ms'], 3)} | {_f(e['outside_share'])} | {tail} |")
    return lines


def _auto_lines(report: dict) -> list[str]:
    """What auto ran with, the sizes it chose, and its speed against the fixed trees (excluding prefill)."""
    a = report["auto"]
    path = a["calibration"]["path"]
    used = "the prior (the draft's own path probabilities)" if path == "prior" else f"`{path}`"
    lines = ["## auto", "",
             f"Cost profile `{a['cost_profile']['path']}` (at most {a['max_nodes']} nodes a round):", "", "```",
             a["cost_table"], "```", "",
             f"Calibration: {used}.",
             "", "| kind | rounds | no draft | nodes when drafted (mean) | nodes verified: rounds | draft depth: rounds | "
             f"auto ms/token / best fixed tree's [95%] | speedup over {a['largest_tree']} [95%] |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, s in a["sizes"].items():
        best, over = a["vs_best_fixed"][kind], a["vs_largest_tree"][kind]
        ratio = _f(best["ratio"]) + (f" {_ci(best['interval'])} ({best['best']})" if "best" in best else " (geomean)")
        speedup = f"{_f(over['speedup'])}x" + (f" {_ci(over['interval'])}" if "interval" in over else " (geomean)")
        hist = ", ".join(f"{n}: {c}" for n, c in s["nodes"].items())
        deep = ", ".join(f"{d}: {c}" for d, c in s.get("draft_depths", {}).items()) or "-"
        lines.append(f"| {kind} | {s['rounds']} | {_f(100 * s['no_draft_share'], 1)}% | "
                     f"{_f(s['mean_nodes_when_drafted'], 1)} | {hist} | {deep} | {ratio} | {speedup} |")
    return lines + ["", "Rounds of every kept run. A ratio below 1 is auto faster than the kind's best fixed tree "
                    "(1.05: 5% slower); the pooled rows are geometric means of the kinds.", ""]


def _calibration_lines(curve: dict) -> list[str]:
    lines = [f"## Node calibration (on the nodes of {', '.join(curve['modes'])})", ""]
    used = curve.get("used")
    if used and used.get("nodes"):
        lines += [f"- auto ran with a calibration fitted on {used['fitted_on']}: Brier score {used['brier']:.4f} "
                  "on this run's nodes", ""]
    if "error" in curve:
        return lines + [f"Not refitted: {curve['error']}", ""]
    lines += [*[f"- {line}" for line in curve["summary"]], "", "| predicted | observed | nodes |", "|---|---|---|"]
    lines += [f"| {_f(b['predicted'], 3)} | {_f(b['observed'], 3)} | {b['nodes']} |" for b in curve["bins"]]
    return lines + ["", "Equal-count bins of verified nodes by the refitted model's predicted acceptance; "
                    "`glance-bench calibrate rounds.jsonl` writes this calibration for auto to use.", ""]


def law_table(fits: dict) -> list[str]:
    lines = ["| rounds of | rounds (prompts) | b0 [95%] | b1 [95%] | rank corr. (p) | LR test p | "
             "decile R^2 | deciles covering the law | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for name, f in fits.items():
        lines.append(f"| {name} | {f['rounds']} ({f['prompts']}) | {_f(f['b0'])} {_ci(f['b0_interval'])} | "
                     f"{_f(f['b1'])} {_ci(f['b1_interval'])} | {_f(f['spearman_rho'])} ({_p(f['spearman_p'])}) | "
                     f"{_p(f['lr_p'])} | {_f(f['decile_r2'])} | {_f(f['decile_coverage'])} | {f['verdict']} |")
    return lines


def render(report: dict) -> str:
    c, s = report["conditions"], report["settings"]
    out = ["# glance-bench report", "",
           f"`{c['command']}`", "",
           f"Backend {c['backend']} ({c.get('providers') or 'default'}), threads {c.get('threads') or 'default'}, "
           f"{c['cpus']} CPUs, {c['platform']}; load average {c['load_start']} at start, {c['load_end']} at end; "
           f"{c['started']} to {c['finished']}.", "",
           f"Per prompt, {s['samples']} interleaved samples of every mode (order rotated per sample), the first "
           f"dropped as a warm-up; {s['prompts']} prompts; block {s['block_size']}, branch {s['branch_k']}, "
           f"max {s['max_new_tokens']} new tokens, drafts: {s['drafts']}. ms/token is a ratio of sums over "
           "prompts (each prompt's median kept run); tau pools rounds and counts the bonus token; speedup = AR "
           "ms/token over the mode's, both from the same prompts, with paired bootstrap 95% intervals over prompts "
           f"({s['bootstrap']} replicates); kinds combine by geometric mean. 'Excl. prefill' counts the rounds "
           "and the tokens they commit; 'incl.' counts the whole answer.", "",
           "## Speed", "", *_speed_table(report), ""]
    budgets = sorted({b for v in report["tree_vs_chain"].values() for b in v}, key=int)
    if budgets:  # only with --chain
        out += ["## Tree against chain at equal rows verified", "",
                "| budget | " + " | ".join(report["tree_vs_chain"]) + " |", "|---|" + "---|" * len(report["tree_vs_chain"])]
        for b in budgets:
            out.append(f"| {b} | " + " | ".join(_f(v.get(b)) + "x" for v in report["tree_vs_chain"].values()) + " |")
        out += ["", "tau of the tree over tau of the chain (branch 1) with the same head and the same node budget.", ""]
    out += ["## Loop efficiency (all kinds pooled; ms per round)", "", *_efficiency_table(report), "",
            "Ideal speedup: AR's model cost per token over the mode's model cost per committed token (model cost: "
            f"{report['pooled']['modes']['ar'].get('cost_source', 'n/a')}), i.e. what the measured acceptance would "
            "give if nothing ran outside the graphs; 'achieved / ideal' is the share the runtime keeps. Tokens "
            "per round is tau after the answer's end clips the last round.", "",
            f"## The draftability law (rounds of {report['law_mode']}, one kept sample per prompt)", "",
            "`logit p = b0 - b1 H`, accepted drafted tokens truncated-geometric in p with cap min(budget, B-1), "
            "fitted by maximum likelihood; intervals from a bootstrap over prompts; rank correlation with a "
            "permutation p-value; LR test against a constant p. b1 > 0 (slope -b1 < 0) is the law's direction. "
            "Each answer's final round is left out (the answer's end, not the target's uncertainty, cuts its "
            "acceptance); the last table keeps it.",
            "", *law_table(report["law"]), "", "Pooled fit per mode:", "", *law_table(report["law_by_mode"]), "",
            "Pooled, final rounds included:", "",
            *law_table({f"{report['law_mode']} + final": report["law_with_final_rounds"]}), "",
            *(_auto_lines(report) if "auto" in report else []),
            *_calibration_lines(report["calibration_curve"])]
    if "expectations" in report:
        out += ["## Expectations (--expect)", "", *[f"- {expect_line(e)}" for e in report["expectations"]], ""]
    out += ["", "## Files", "", *[f"- `{name}`" for name in report["files"]], ""]
    return "\n".join(out)
