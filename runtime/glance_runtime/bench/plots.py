"""The bench's PNG plots (the law, speedups, verify cost; with auto, its chosen sizes; the calibration curve).
matplotlib is the `bench` extra; without it the bench says so in one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import GlanceError
from .law import MIN_ROUNDS, LawFit, expected_accepted
from .auto_summary import PRIOR_NAME
from .law_log import POOLED


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or a one-line fix."""
    try:
        import matplotlib
    except ImportError:
        raise GlanceError("plots need matplotlib: pip install 'glance-toolkit[bench]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_law(path: Path, fits: dict[str, LawFit], rows: list[dict], mode: str) -> None:
    """Accepted drafted tokens against anchor entropy: rounds (jittered), decile means with 95% intervals,
    and the fitted law, one panel per kind and one pooled."""
    plt = pyplot()
    names = list(fits)
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.4), squeeze=False, sharey=True)
    rng = np.random.default_rng(0)
    for ax, name in zip(axes[0], names):
        fit = fits[name]
        sel = [r for r in rows if name == "pooled" or str(r.get("kind")) == name]
        h = np.array([r["entropy"] for r in sel])
        a = np.array([r["drafted"] for r in sel], dtype=float)
        ax.scatter(h, a + rng.uniform(-0.15, 0.15, len(a)), s=5, alpha=0.2, color="grey", label="rounds")
        d = fit.deciles
        ax.errorbar([x.entropy for x in d], [x.accepted for x in d],
                    yerr=[[x.accepted - x.lo for x in d], [x.hi - x.accepted for x in d]],
                    fmt="o", color="C0", capsize=2, label="decile means (95%)")
        if fit.rounds < MIN_ROUNDS:
            ax.text(0.5, 0.5, f"law not fitted:\n{fit.rounds} rounds of the {MIN_ROUNDS} it needs",
                    transform=ax.transAxes, ha="center", va="center", fontsize=8, color="C3")
        elif np.isfinite(fit.b1) and len(h):
            grid = np.linspace(h.min(), h.max(), 100)
            cap = max(r["cap"] for r in sel)
            ax.plot(grid, expected_accepted(fit.b0, fit.b1, grid, np.full_like(grid, cap)), color="C3",
                    label=f"law: b0 {fit.b0:.2f}, b1 {fit.b1:.2f}")
        ax.set_title(f"{name} ({fit.rounds} rounds)", fontsize=9)
        ax.set_xlabel("target entropy at the anchor (nats)")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel(f"accepted drafted tokens ({mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_speedup(path: Path, report: dict) -> None:
    """Speedup over AR against budget, per kind and the geometric mean; trees solid, chains dashed, auto
    (whose size varies per round) a dotted level."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    sections = {**report["kinds"], "geomean": report["pooled"]}
    for ax, key, title in ((axes[0], "decode", "excluding prefill"), (axes[1], "with_prefill", "including prefill")):
        for i, (name, section) in enumerate(sections.items()):
            color = "black" if name == "geomean" else f"C{i}"
            for style, kind in (("-o", "tree"), ("--s", "chain")):
                entries = sorted((e for e in section["modes"].values() if e["kind"] == kind), key=lambda e: e["budget"])
                if not entries:
                    continue
                dodge = 2 ** (0.04 * (i - (len(sections) - 1) / 2))  # side by side, so intervals stay readable
                x = [e["budget"] * dodge for e in entries]
                y = [e[f"speedup_{key}"] for e in entries]
                lo = [y_ - e[f"speedup_{key}_interval"][0] for y_, e in zip(y, entries)]
                hi = [e[f"speedup_{key}_interval"][1] - y_ for y_, e in zip(y, entries)]
                ax.errorbar(x, y, yerr=[lo, hi], fmt=style, color=color, capsize=2, markersize=4,
                            label=f"{name} {kind}")
            if "auto" in section["modes"]:
                ax.axhline(section["modes"]["auto"][f"speedup_{key}"], color=color, ls=":", lw=1.2,
                           label=f"{name} auto")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        budgets = sorted({e["budget"] for e in report["pooled"]["modes"].values() if e["kind"] in ("tree", "chain")})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("tree budget (nodes verified besides the anchor)")
        ax.set_title(f"speedup over AR, {title}", fontsize=9)
    axes[0].set_ylabel("AR ms/token / mode ms/token")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_verify_cost(path: Path, rows: list[dict]) -> None:
    """The target's verify cost against packed rows, with the draft pass's cost (draft + its vocab run)
    as a line, so the price of a wider tree and of drafting read off one plot."""
    plt = pyplot()
    timed = all("target_graph_ms" in r for r in rows)
    key = "target_graph_ms" if timed else "verify_ms"
    sizes = np.array([r["tree_size"] for r in rows])
    cost = np.array([r[key] for r in rows])
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.scatter(sizes, cost, s=5, alpha=0.2, color="grey", label="rounds")
    uniq = np.unique(sizes)
    ax.plot(uniq, [np.median(cost[sizes == s]) for s in uniq], "-o", color="C0", label="median")
    draft_key = "draft_graph_ms" if timed else "draft_ms"
    drafts = [r[draft_key] for r in rows if r["tree_size"] > 1]
    if drafts:
        ax.axhline(float(np.median(drafts)), color="C3", ls="--",
                   label="draft graph (median)" if timed else "draft call (median)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(uniq, [str(int(u)) for u in uniq])
    ax.minorticks_off()
    ax.set_xlabel("packed rows verified (anchor included)")
    ax.set_ylabel("target graph ms per verify" if timed else "verify call ms")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_auto_sizes(path: Path, sizes: dict[str, dict]) -> None:
    """How many rounds auto verified each tree size, as shares per kind and pooled: 'no draft' for plain
    greedy steps, else the nodes kept besides the anchor."""
    plt = pyplot()
    kinds = [k for k in sizes if k != POOLED] + [POOLED]
    largest = max((int(n) for k in kinds for n in sizes[k]["nodes"]), default=0)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, kind in enumerate(kinds):
        s = sizes[kind]
        counts = np.zeros(largest + 2)  # position 0: no draft; n + 1: n nodes
        counts[0] = s["no_draft"]
        for n, count in s["nodes"].items():
            counts[int(n) + 1] = count
        pooled = kind == POOLED
        ax.stairs(counts / max(s["rounds"], 1), np.arange(-1.5, largest + 1), color="black" if pooled else f"C{i}",
                  lw=2 if pooled else 1.2, label=f"{kind} ({s['rounds']} rounds)")
    step = max(1, (largest + 7) // 8)
    ticks = sorted({-1, *range(step, largest + 1, step), largest} - {0})
    ax.set_xticks(ticks, ["no draft" if t < 0 else str(t) for t in ticks], fontsize=7)
    ax.set_xlabel("nodes auto verified besides the anchor")
    ax.set_ylabel("share of rounds")
    ax.set_title("tree sizes chosen by auto", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_calibration(path: Path, curve: dict) -> None:
    """Observed node acceptance against predicted, in equal-count bins: the calibration auto ran with, one
    refitted on this run, and the draft's own probabilities (its path scores), with the diagonal a
    calibrated model lies on."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.2, 4.0))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, label="calibrated")
    curves = [(curve["prior_bins"], "--s", "draft's own probability"),
              (curve["bins"], "-o", f"refitted here (Brier {curve['brier']:.3f})")]
    used = curve.get("used") or {}
    if used.get("bins") and used["fitted_on"] != PRIOR_NAME:
        curves.append((used["bins"], "-^", f"used by auto (Brier {used['brier']:.3f})"))
    for bins, style, label in curves:
        ax.plot([b["predicted"] for b in bins], [b["observed"] for b in bins], style, markersize=4, label=label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted acceptance of a node")
    ax.set_ylabel("observed share accepted")
    ax.set_title(f"node calibration ({curve['nodes']} nodes of {', '.join(curve['modes'])})", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
