"""The draftability law: per round, `logit p = b0 - b1 * H` (H: the target's entropy at the anchor, nats),
with accepted drafted tokens a ~ truncated geometric: P(a = k) = p^k (1 - p) for k < L, P(a = L) = p^L,
so E[a | H] = p (1 - p^L) / (1 - p) (L: the round's cap, min(budget, B - 1)).

Fitted by maximum likelihood. The likelihood is a binomial one (a successes, one failure unless
a = L), so Newton's method on the logistic log-likelihood finds the unique maximum. Diagnostics: a
cluster (per-prompt) bootstrap interval for b0 and b1, a likelihood-ratio test against a constant p,
Spearman's rank correlation with a permutation p-value, and how the law's curve meets the decile means.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from .stats import cluster_indices, interval, spearman

DECILES = 10
MIN_ROUNDS = 20  # fewer rounds give a fit (and a curve) too unstable to mean anything: not fitted, and said so


@dataclass
class Decile:
    entropy: float  # mean H of the bin
    accepted: float  # mean accepted drafted tokens
    lo: float  # bootstrap 95% interval of that mean
    hi: float
    predicted: float  # mean of the law's E[a | H] over the bin's rounds
    rounds: int


@dataclass
class LawFit:
    rounds: int
    prompts: int
    b0: float
    b1: float  # > 0: acceptance falls as entropy rises (the law's direction)
    b0_interval: tuple[float, float]
    b1_interval: tuple[float, float]
    converged: bool
    log_likelihood: float
    lr_statistic: float  # 2 * (loglik - loglik of a constant p)
    lr_p: float  # chi-square(1) p-value of b1 = 0
    spearman_rho: float  # rank correlation of H and a (negative where the law holds)
    spearman_p: float
    entropy_range: tuple[float, float]
    mean_accepted: float
    deciles: list[Decile] = field(default_factory=list)
    decile_r2: float = float("nan")  # 1 - SS(means - law) / SS(means - grand mean), weighted by rounds
    decile_rmse: float = float("nan")
    decile_coverage: float = float("nan")  # share of decile intervals that contain the law's value
    verdict: str = ""

    @property
    def slope(self) -> float:
        """d logit p / dH = -b1: negative where acceptance falls with entropy."""
        return -self.b1

    def as_dict(self) -> dict:
        return {**asdict(self), "slope": self.slope}


def _sigmoid(eta: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-eta) without overflow for large |eta| (a steep fit)."""
    return np.exp(-np.logaddexp(0, -eta))


def expected_accepted(b0: float, b1: float, entropy: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """E[a | H] = p (1 - p^L) / (1 - p) = sum_{k=1..L} p^k, capped at L by construction."""
    p = _sigmoid(b0 - b1 * np.asarray(entropy, dtype=float))
    cap = np.asarray(cap, dtype=float)
    near_one = np.abs(1 - p) < 1e-9
    safe = np.where(near_one, 0.5, p)
    return np.where(near_one, cap, safe * (1 - safe ** cap) / (1 - safe))


def _loglik(eta: np.ndarray, success: np.ndarray, failure: np.ndarray) -> float:
    # log p = -log(1 + e^-eta), log(1 - p) = -log(1 + e^eta)
    return float(-(success * np.logaddexp(0, -eta)).sum() - (failure * np.logaddexp(0, eta)).sum())


def _newton(x: np.ndarray, success: np.ndarray, failure: np.ndarray, ridge: float = 1e-6,
            steps: int = 100) -> tuple[np.ndarray, bool]:
    """Maximise the (barely) ridged binomial log-likelihood; the ridge keeps a separated fit finite."""
    w = np.zeros(x.shape[1])
    trials = success + failure

    def objective(v: np.ndarray) -> float:
        return _loglik(x @ v, success, failure) - ridge * float(v @ v)

    current = objective(w)
    for _ in range(steps):
        p = _sigmoid(x @ w)
        grad = x.T @ (success - trials * p) - 2 * ridge * w
        hess = (x * (trials * p * (1 - p))[:, None]).T @ x + 2 * ridge * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        scale = 1.0
        while scale > 1e-8:
            trial = objective(w + scale * step)
            if trial >= current - 1e-12:
                break
            scale /= 2
        w, previous, current = w + scale * step, current, objective(w + scale * step)
        if abs(current - previous) < 1e-10 and np.max(np.abs(scale * step)) < 1e-8:
            return w, bool(np.all(np.abs(w) < 30))
    return w, False


def fit(entropy: Sequence[float], accepted: Sequence[int], cap: Sequence[int]) -> tuple[float, float, bool]:
    """Maximum-likelihood (b0, b1, converged) for accepted drafted tokens `accepted` (0..cap)."""
    h = np.asarray(entropy, dtype=float)
    a = np.asarray(accepted, dtype=float)
    cap_arr = np.asarray(cap, dtype=float)
    failure = (a < cap_arr).astype(float)
    mean, scale = h.mean(), h.std()
    if scale < 1e-12:
        w, ok = _newton(np.ones((len(h), 1)), a, failure)
        return float(w[0]), float("nan"), ok
    x = np.column_stack([np.ones_like(h), (h - mean) / scale])
    w, ok = _newton(x, a, failure)
    return float(w[0] - w[1] * mean / scale), float(-w[1] / scale), ok


def _deciles(h: np.ndarray, a: np.ndarray, predicted: np.ndarray, rng: np.random.Generator,
             replicates: int) -> list[Decile]:
    """Rounds sorted by H in ten near-equal bins (ties may straddle two bins), each with its mean and interval."""
    order = np.argsort(h, kind="mergesort")
    bins = []
    for idx in np.array_split(order, min(DECILES, len(order))):
        means = [a[rng.choice(idx, len(idx))].mean() for _ in range(replicates)]
        lo, hi = interval(means)
        bins.append(Decile(float(h[idx].mean()), float(a[idx].mean()), lo, hi, float(predicted[idx].mean()), len(idx)))
    return bins


def _lr_note(f: LawFit) -> str:
    """The model-based LR test trusts the geometric spread; accepted lengths far less spread out than a
    geometric's (templated answers) make it weak while the model-free interval and ranks are clear."""
    return "" if f.lr_p < 0.05 else f"; the LR test alone is not significant (p {f.lr_p:.3g})"


def _verdict(f: LawFit) -> str:
    if f.rounds < MIN_ROUNDS:
        return f"not fitted: {f.rounds} rounds are too few to fit or test the law (it needs {MIN_ROUNDS})"
    if f.entropy_range[1] - f.entropy_range[0] < 1e-3:
        return "the anchor entropy barely varies here, so the law cannot be tested"
    lo, hi = f.b1_interval
    fit_note = (f"; the decile means follow the fitted curve (R^2 {f.decile_r2:.2f})" if f.decile_r2 >= 0.5
                else f"; but the decile means depart from the fitted curve (R^2 {f.decile_r2:.2f})")
    if lo > 0 and f.spearman_rho < 0 and f.spearman_p < 0.05:
        return ("holds: accepted length falls as entropy rises (b1 > 0, 95% interval above 0; rank correlation "
                f"{f.spearman_rho:.2f}, p {f.spearman_p:.3g})" + fit_note + _lr_note(f))
    if hi < 0 and f.spearman_rho > 0 and f.spearman_p < 0.05:
        return ("contradicted: accepted length rises with entropy (b1 < 0, 95% interval below 0; rank correlation "
                f"{f.spearman_rho:.2f}, p {f.spearman_p:.3g})" + fit_note + _lr_note(f))
    return (f"inconclusive: b1 {f.b1:.2f} (95% interval {lo:.2f} to {hi:.2f}), rank correlation "
            f"{f.spearman_rho:.2f} (p {f.spearman_p:.3g})")


def analyse(entropy: Sequence[float], accepted: Sequence[int], cap: Sequence[int], groups: Sequence | None = None,
            replicates: int = 500, permutations: int = 2000, seed: int = 0) -> LawFit:
    """Fit the law and every diagnostic. `accepted` counts drafted tokens only (tau - 1); `groups` (one
    prompt id per round) make the bootstrap resample whole answers."""
    rng = np.random.default_rng(seed)
    h = np.asarray(entropy, dtype=float)
    a = np.asarray(accepted, dtype=float)
    c = np.asarray(cap, dtype=float)
    if np.any(a < 0) or np.any(a > c):
        raise ValueError("accepted drafted tokens must lie in 0..cap")
    groups = list(range(len(h))) if groups is None else list(groups)
    if len(h) < MIN_ROUNDS:
        nan = float("nan")
        out = LawFit(len(h), len(set(groups)), nan, nan, (nan, nan), (nan, nan), False, nan, nan, nan, nan, nan,
                     (nan, nan), float(a.mean()) if len(a) else nan)
        out.verdict = _verdict(out)
        return out
    b0, b1, ok = fit(h, a, c)
    replicas = []
    for _ in range(replicates if len(h) > 1 else 0):
        idx = cluster_indices(groups, rng)
        replicas.append(fit(h[idx], a[idx], c[idx])[:2])
    b0s, b1s = (np.asarray([r[i] for r in replicas]) for i in (0, 1))
    failure = (a < c).astype(float)
    full = _loglik(b0 - b1 * h, a, failure) if np.isfinite(b1) else float("nan")
    p0 = a.sum() / max(a.sum() + failure.sum(), 1e-12)
    null = _loglik(np.full_like(h, math.log(max(p0, 1e-12) / max(1 - p0, 1e-12))), a, failure)
    lr = max(0.0, 2 * (full - null)) if np.isfinite(full) else float("nan")
    rho, rho_p = spearman(h, a, permutations, rng) if len(h) > 2 else (float("nan"), float("nan"))
    slope_ok = np.isfinite(b1)
    predicted = expected_accepted(b0, b1 if slope_ok else 0.0, h, c)
    out = LawFit(rounds=len(h), prompts=len(set(groups)), b0=b0, b1=b1, b0_interval=interval(b0s),
                 b1_interval=interval(b1s), converged=ok, log_likelihood=full, lr_statistic=lr,
                 lr_p=math.erfc(math.sqrt(lr / 2)) if np.isfinite(lr) else float("nan"),
                 spearman_rho=rho, spearman_p=rho_p,
                 entropy_range=(float(h.min()), float(h.max())) if len(h) else (float("nan"),) * 2,
                 mean_accepted=float(a.mean()) if len(a) else float("nan"))
    if len(h):
        out.deciles = _deciles(h, a, predicted, rng, 200)
        means = np.array([d.accepted for d in out.deciles])
        law = np.array([d.predicted for d in out.deciles])
        n = np.array([d.rounds for d in out.deciles], dtype=float)
        total = (n * (means - np.average(means, weights=n)) ** 2).sum()
        out.decile_r2 = float(1 - (n * (means - law) ** 2).sum() / total) if total > 0 else float("nan")
        out.decile_rmse = float(np.sqrt(np.average((means - law) ** 2, weights=n)))
        out.decile_coverage = float(np.mean([d.lo - 1e-9 <= d.predicted <= d.hi + 1e-9 for d in out.deciles]))
    out.verdict = _verdict(out)
    return out

