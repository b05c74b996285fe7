"""Small numpy statistics the bench reports: geometric means, bootstrap intervals, rank correlation.

Written here rather than taken from scipy so the bench stays numpy-only on an edge install.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def geomean(values: Sequence[float]) -> float:
    """Geometric mean: how speedups of several task kinds combine (the paper's convention)."""
    v = np.asarray(values, dtype=float)
    return float(np.exp(np.mean(np.log(v)))) if v.size else float("nan")


def interval(samples: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if not s.size:
        return float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(s, [tail, 100 - tail])
    return float(lo), float(hi)


def bootstrap(statistic: Callable[[np.ndarray], float], n: int, replicates: int,
              rng: np.random.Generator) -> list[float]:
    """Replicates of `statistic(indices)` over indices 0..n-1 drawn with replacement."""
    return [statistic(rng.integers(0, n, n)) for _ in range(replicates)] if n else []


def cluster_indices(groups: Sequence, rng: np.random.Generator) -> np.ndarray:
    """Row indices of one cluster bootstrap draw: whole groups (prompts) resampled with replacement,
    since rounds of one answer are not independent."""
    keys = sorted(set(groups), key=str)
    members = {k: [] for k in keys}
    for i, g in enumerate(groups):
        members[g].append(i)
    picks = rng.integers(0, len(keys), len(keys))
    return np.concatenate([np.asarray(members[keys[j]], dtype=int) for j in picks])


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    sorted_x = x[order]
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = (start + end + 1) / 2
            start = end
    return ranks


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denom) if denom > 0 else float("nan")


def spearman(x: Sequence[float], y: Sequence[float], permutations: int,
             rng: np.random.Generator) -> tuple[float, float]:
    """Spearman's rho and a two-sided permutation p-value ((1 + as extreme) / (1 + permutations))."""
    rx, ry = rankdata(np.asarray(x)), rankdata(np.asarray(y))
    rho = _pearson(rx, ry)
    if not np.isfinite(rho):
        return rho, float("nan")
    extreme = sum(abs(_pearson(rx, rng.permutation(ry))) >= abs(rho) - 1e-12 for _ in range(permutations))
    return rho, (1 + extreme) / (1 + permutations)
