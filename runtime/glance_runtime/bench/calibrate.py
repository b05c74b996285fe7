"""Fit `--budget auto`'s calibration (see glance_runtime.decode.calibration) from a round log.

Every verified node of a drafted round is one labelled sample: its path score s, its depth, the round's
anchor surprisal u, and whether the walk accepted it. The node model is a logistic regression on
x = logit(exp(s)) and depth and, only where it helps, on u: a likelihood-ratio test must find it (p < 0.05)
and it must predict answers it was not fitted on better (two-fold cross-validation over answers), since a
term that only fits its own rounds would size trees worse. Coefficients that would make a node likelier
than its parent (b < 0 or a positive depth slope) are dropped. The law is the draftability law's
truncated-geometric fit (`law.fit`) with u in place of the entropy; its slope is kept only where it is
significant and points the law's way (acceptance falls as surprisal rises), else p is the pooled rate.
First rounds (no u yet) inform the node model without u only.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..decode.calibration import Calibration, path_logit
from ..errors import GlanceError
from .law import _loglik, _newton, fit

ALPHA = 0.05
BINS = 10
MIN_NODES = 20


def _chi2_p(statistic: float) -> float:
    """Upper tail of chi-square with one degree of freedom."""
    return math.erfc(math.sqrt(max(statistic, 0.0) / 2))


def _logistic(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    w, _ = _newton(x, y, 1 - y)
    return w, _loglik(x @ w, y, 1 - y)


def node_samples(rows: Sequence[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(path scores, depths, surprisal (NaN in first rounds), accepted 0/1, answer number) of every verified
    node of drafted rounds. Logs from before depths were recorded cannot be used."""
    scores, depths, surprisal, accepted, answers = [], [], [], [], []
    numbers: dict[tuple, int] = {}
    for row in rows:
        nodes = row.get("node_scores") or []
        if not row.get("drafted", True) or not nodes:
            continue
        if len(row.get("node_depths") or []) != len(nodes):
            raise GlanceError("the round log has node scores without their depths; rerun glance-bench with this version")
        on_path = set(row.get("path") or [])
        u = row.get("surprisal")
        scores += nodes
        depths += row["node_depths"]
        surprisal += [float("nan") if u is None else float(u)] * len(nodes)
        accepted += [1.0 if i + 1 in on_path else 0.0 for i in range(len(nodes))]
        answer = (row.get("kind"), row.get("prompt"), row.get("mode"), row.get("sample"))
        answers += [numbers.setdefault(answer, len(numbers))] * len(nodes)
    return tuple(np.asarray(v, float) for v in (scores, depths, surprisal, accepted, answers))


def _monotone(columns: list[np.ndarray], y: np.ndarray) -> np.ndarray:
    """Logistic weights on [1, x, depth, ...], refitted without depth (then without x) while a weight would
    make a child likelier than its parent; dropped weights are 0."""
    w, _ = _logistic(np.column_stack(columns), y)
    if w[2] > 0:
        w, _ = _logistic(np.column_stack([columns[0], columns[1], *columns[3:]]), y)
        w = np.insert(w, 2, 0.0)
    if w[1] < 0:
        rest = [columns[0], *columns[3:]]
        w, _ = _logistic(np.column_stack(rest), y)
        w = np.concatenate([[w[0], 0.0, 0.0], w[1:]])
    return w


def _held_out_gain(x: np.ndarray, extra: np.ndarray, y: np.ndarray, answers: np.ndarray) -> float:
    """Log-likelihood on answers left out, with `extra` as a column minus without it, over two folds."""
    fold = answers % 2 == 0
    gain = 0.0
    for train in (fold, ~fold):
        test = ~train
        if train.sum() < MIN_NODES or not test.any():
            return float("-inf")
        for sign, cols in ((-1.0, x), (1.0, np.column_stack([x, extra]))):
            w, _ = _logistic(cols[train], y[train])
            gain += sign * _loglik(cols[test] @ w, y[test], 1 - y[test])
    return gain


def _node_model(scores: np.ndarray, depths: np.ndarray, u: np.ndarray, y: np.ndarray, answers: np.ndarray
                ) -> tuple[tuple[float, float, float, float], dict]:
    """(a, b, c, d) and whether u earned its place."""
    x, ones = path_logit(scores), np.ones_like(scores)
    a, b, d = _monotone([ones, x, depths], y)
    coef, lr_p, gain = (float(a), float(b), 0.0, float(d)), float("nan"), float("nan")
    known = ~np.isnan(u)
    if known.sum() >= MIN_NODES and np.ptp(u[known]) > 1e-9:
        base = np.column_stack([ones[known], x[known], depths[known]])
        _, ll_without = _logistic(base, y[known])
        with_u, ll_with = _logistic(np.column_stack([base, u[known]]), y[known])
        lr_p = _chi2_p(2 * (ll_with - ll_without))
        gain = _held_out_gain(base, u[known], y[known], answers[known])
        if lr_p < ALPHA and gain > 0 and with_u[1] >= 0 and with_u[2] <= 0:
            coef = (float(with_u[0]), float(with_u[1]), float(with_u[3]), float(with_u[2]))
    return coef, {"surprisal_lr_p": lr_p, "surprisal_held_out_gain": gain, "uses_surprisal": coef[2] != 0.0}


def _law(rows: Sequence[dict]) -> tuple[tuple[float, float] | None, dict]:
    """Per-offset acceptance against the anchor's surprisal over drafted rounds with a known u."""
    kept = [r for r in rows if r.get("drafted", True) and r.get("node_scores") and r.get("surprisal") is not None
            and r.get("cap")]
    if len(kept) < 3:
        return None, {"rounds": len(kept), "note": "too few drafted rounds with a known surprisal; no law, every round drafts"}
    u = np.array([r["surprisal"] for r in kept], float)
    # drafted tokens accepted: the path (a round ended by a drafted stop token commits no bonus after it)
    a = np.array([min(len(r.get("path") or []), r["cap"]) for r in kept], float)
    cap = np.array([r["cap"] for r in kept], float)
    failure = (a < cap).astype(float)
    pooled = a.sum() / max(a.sum() + failure.sum(), 1e-12)
    pooled = min(max(pooled, 1e-6), 1 - 1e-6)
    b0_const = math.log(pooled / (1 - pooled))
    ll_const = _loglik(np.full_like(u, b0_const), a, failure)
    info = {"rounds": len(kept), "pooled_p": pooled}
    if np.ptp(u) > 1e-9:
        b0, b1, _ = fit(u, a, cap)
        lr_p = _chi2_p(2 * (_loglik(b0 - b1 * u, a, failure) - ll_const))
        info.update(b0=b0, b1=b1, lr_p=lr_p)
        if lr_p < ALPHA and b1 > 0:
            return (b0, b1), {**info, "uses_surprisal": True}
    return (b0_const, 0.0), {**info, "uses_surprisal": False}


def _bins(predicted: np.ndarray, y: np.ndarray) -> list[dict]:
    """Nodes sorted by predicted acceptance in equal-count bins: the calibration curve."""
    order = np.argsort(predicted, kind="mergesort")
    return [{"predicted": float(predicted[idx].mean()), "observed": float(y[idx].mean()), "nodes": int(len(idx))}
            for idx in np.array_split(order, min(BINS, len(order))) if len(idx)]


def judged(calibration: Calibration, rows: Sequence[dict]) -> dict:
    """How well a given calibration (the one auto ran with) predicts the nodes of `rows`: Brier score and bins."""
    scores, depths, u, y, _ = node_samples(rows)
    if not len(y):
        return {"nodes": 0}
    predicted = calibration.node_probability(scores, u, depths)
    return {"nodes": int(len(y)), "brier": float(np.mean((predicted - y) ** 2)), "bins": _bins(predicted, y)}


def fit_calibration(rows: Sequence[dict], source: str = "") -> tuple[Calibration, dict]:
    """The calibration and a report (coefficients, tests, Brier scores against the prior, the curve's bins)."""
    scores, depths, u, y, answers = node_samples(rows)
    if len(y) < MIN_NODES:
        raise GlanceError(f"the round log holds {len(y)} drafted nodes with their scores, too few to calibrate "
                          f"(at least {MIN_NODES}); rerun glance-bench with fixed tree budgets on more prompts")
    (a, b, c, d), node_info = _node_model(scores, depths, u, y, answers)
    law, law_info = _law(rows)
    modes = sorted({str(r.get("mode")) for r in rows if r.get("node_scores")})
    known = u[~np.isnan(u)]
    calibration = Calibration(a, b, c, d, law=law, surprisal_mean=float(known.mean()) if len(known) else 0.0,
                              fitted_on={"nodes": int(len(y)), "rounds": sum(1 for r in rows if r.get("node_scores")),
                                         "modes": modes, "source": source})
    predicted = calibration.node_probability(scores, u, depths)
    prior = np.exp(np.minimum(scores, 0.0))
    report = {"nodes": int(len(y)), "accepted_share": float(y.mean()),
              "node": {"a": a, "b": b, "c": c, "d": d, **node_info},
              "law": law_info, "brier": float(np.mean((predicted - y) ** 2)),
              "prior_brier": float(np.mean((prior - y) ** 2)), "bins": _bins(predicted, y),
              "prior_bins": _bins(prior, y)}
    return calibration, report


def summary_lines(calibration: Calibration, report: dict) -> list[str]:
    node, law = report["node"], report["law"]
    lines = [f"{report['nodes']} verified nodes, {report['accepted_share']:.1%} accepted",
             f"node model: logit q = {node['a']:.3f} + {node['b']:.3f} * logit(exp(score)) {node['d']:+.3f} * depth"
             + (f" + {node['c']:.3f} * surprisal" if node["uses_surprisal"] else
                f" (surprisal left out: LR p {node['surprisal_lr_p']:.3g}, held-out log-likelihood gain "
                f"{node['surprisal_held_out_gain']:.3g})"),
             f"Brier score {report['brier']:.4f} (the draft's own probabilities: {report['prior_brier']:.4f})"]
    if calibration.law is None:
        lines.append(f"law: {law['note']}")
    else:
        b0, b1 = calibration.law
        lines.append(f"law: logit p = {b0:.3f} - {b1:.3f} * surprisal over {law['rounds']} rounds"
                     + ("" if law["uses_surprisal"] else " (constant: the surprisal slope is not significant)"))
    return lines
