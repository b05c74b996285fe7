"""The bench's three PNG plots. matplotlib is the `bench` extra; without it the bench says so in one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import GlanceError
from .law import LawFit, expected_accepted

PLOTS = ("law.png", "speedup.png", "verify_cost.png")


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
        if np.isfinite(fit.b1) and len(h):
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
    """Speedup over AR against budget, per kind and the geometric mean; trees solid, chains dashed."""
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
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        budgets = sorted({e["budget"] for e in report["pooled"]["modes"].values() if e["kind"] != "ar"})
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
