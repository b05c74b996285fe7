"""How likely a drafted node is to be accepted, and a round to repay its draft: the numbers `--budget auto`
decides with, fitted from round logs (`glance-bench calibrate`) and stored as `calibration.json`.

Two small logistic models, both on quantities a round has before it verifies:
- node: P(node on the accepted path) = sigmoid(a + b * x + d * depth + c * u), with x = logit(exp(s)) for
  the node's path score s (the draft's summed log-probs down to it), its depth (a block head's offsets
  grow less reliable with distance, beyond what its scores admit) and u the anchor's surprisal, -log of
  the target's probability of the anchor it just chose (free: every projection returns top-1 log-probs).
  With a = c = d = 0 and b = 1 this is exp(s), the draft's own belief: the prior where no fit exists.
- law: the draftability law with what is known before the draft: each offset is accepted with
  p = sigmoid(b0 - b1 * u), so a round expects p + p^2 + ... drafted tokens. The paper's law uses
  the Shannon entropy at the anchor, which only the verify pass computes; u is the min-entropy of the
  row that produced the anchor (-log of its top probability), the nearest quantity on hand.
The c and b1 terms are kept only where they help (see `glance_runtime.bench.calibrate`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..store.atomic import write_file
from ..errors import GlanceError
from ..formats.common import parse, read_text
from ..store.input_files import present

FILE = "calibration.json"
REFIT = "refit it with `glance-bench calibrate`"
NEWTON_STEPS = 12  # Newton steps of a refit at most (from the calibration's own coefficients: a few suffice)
FORMAT = "glance-calibration"
FORMAT_VERSION = 1


def path_logit(scores: np.ndarray) -> np.ndarray:
    """logit(exp(s)) = s - log(1 - e^s): the draft's path probability on the logistic scale."""
    s = np.minimum(np.asarray(scores, dtype=float), -1e-9)
    return s - np.log(-np.expm1(s))


def _sigmoid(z: np.ndarray | float) -> np.ndarray:
    """1 / (1 + e^-z) without overflow at large |z|."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(z, dtype=float)))


def _map_logistic(x: np.ndarray, y: np.ndarray, offset: np.ndarray, centre: np.ndarray, free: np.ndarray,
                  prior: float) -> np.ndarray:
    """The coefficients maximising the log-likelihood of y under sigmoid(x @ theta + offset) less
    prior / 2 * |theta - centre|^2, the coefficients not `free` held at the centre: Newton steps from the centre,
    halved until they gain (a step from far away may overshoot)."""
    theta = centre.copy()

    def objective(t: np.ndarray) -> float:
        z = x @ t + offset
        return float(np.sum(y * z - np.logaddexp(0.0, z)) - prior / 2 * np.sum((t - centre) ** 2))

    best = objective(theta)
    for _ in range(NEWTON_STEPS):
        p = _sigmoid(x @ theta + offset)
        gradient = (x.T @ (y - p) - prior * (theta - centre))[free]
        hessian = ((x * (p * (1 - p))[:, None]).T @ x)[np.ix_(free, free)] + prior * np.eye(int(free.sum()))
        step = np.zeros_like(theta)
        step[free] = np.linalg.solve(hessian, gradient)
        for _ in range(20):
            gained = objective(theta + step)
            if gained >= best:
                theta, best = theta + step, gained
                break
            step /= 2
        else:
            break
    return theta


@dataclass(frozen=True)
class Calibration:
    a: float = 0.0
    b: float = 1.0
    c: float = 0.0
    d: float = 0.0
    law: tuple[float, float] | None = None  # (b0, b1); None: no law fitted, every round drafts
    surprisal_mean: float = 0.0  # stands in for u where none is known yet (the first round)
    fitted_on: dict = field(default_factory=dict)  # rounds, nodes, source: what the fit saw

    @property
    def fitted(self) -> bool:
        return bool(self.fitted_on)

    def node_probability(self, scores: np.ndarray, surprisal: float | np.ndarray | None,
                         depths: np.ndarray | None = None) -> np.ndarray:
        """P(accepted) of each node from its path score and depth (and u: a scalar, or one per node with NaN
        where unknown); never rises down a path, as long as b >= 0 and d <= 0."""
        u = np.asarray(np.nan if surprisal is None else surprisal, dtype=float)
        u = np.where(np.isnan(u), self.surprisal_mean, u)
        depth = 0.0 if depths is None else np.asarray(depths, dtype=float)
        return _sigmoid(self.a + self.b * path_logit(scores) + self.d * depth + self.c * u)

    def node_scorer(self, surprisal: float | None) -> Callable[[float, int], float]:
        """node_probability for one node at a time, in plain floats: what a tree grown node by node calls."""
        base = self.a + self.c * (self.surprisal_mean if surprisal is None else surprisal)
        b, d = self.b, self.d
        log, expm1, exp = math.log, math.expm1, math.exp  # locals: called for every node a tree grows

        def q(score: float, depth: int) -> float:
            s = score if score < -1e-9 else -1e-9
            z = base + b * (s - log(-expm1(s))) + d * depth
            return 1.0 / (1.0 + exp(-z)) if z > -700 else 0.0

        return q

    def refitted(self, scores: np.ndarray, depths: np.ndarray, surprisals: np.ndarray, accepted: np.ndarray,
                 prior: float) -> "Calibration":
        """The node model's a, b and d refitted to verified nodes (their path scores, depths, anchors' surprisals,
        NaN where unknown, and whether each was accepted), by maximum likelihood pulled toward this calibration's
        own coefficients with a Gaussian prior of precision `prior` (a few dozen nodes then outweigh it, a handful
        do not); c and the law are kept. b >= 0 and d <= 0 hold (growing a tree in falling q needs them): a fit
        past either bound is fitted again with that coefficient at the bound."""
        x = np.column_stack([np.ones(len(scores)), path_logit(scores), np.asarray(depths, dtype=float)])
        u = np.asarray(surprisals, dtype=float)
        offset = self.c * np.where(np.isnan(u), self.surprisal_mean, u)
        y = np.asarray(accepted, dtype=float)
        centre = np.array([self.a, max(self.b, 0.0), min(self.d, 0.0)])
        free = np.ones(3, dtype=bool)
        while True:
            theta = _map_logistic(x, y, offset, centre, free, prior)
            bad = free & ((np.arange(3) == 1) & (theta < 0) | (np.arange(3) == 2) & (theta > 0))
            if not bad.any():
                break
            free &= ~bad
            centre = np.where(bad, 0.0, centre)
        a, b, d = theta.tolist()
        return replace(self, a=a, b=b, d=d)

    def offset_acceptance(self, surprisal: float | None) -> float | None:
        """The law's per-offset acceptance p before drafting; None where no law is fitted or nothing is known."""
        if self.law is None or surprisal is None:
            return None
        b0, b1 = self.law
        return float(_sigmoid(b0 - b1 * surprisal))

    def as_dict(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION,
                "node": {"a": self.a, "b": self.b, "c": self.c, "d": self.d, "surprisal_mean": self.surprisal_mean},
                "law": None if self.law is None else {"b0": self.law[0], "b1": self.law[1]},
                "fitted_on": self.fitted_on}

    @classmethod
    def from_dict(cls, raw: dict) -> "Calibration":
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
            found = (raw.get("format"), raw.get("format_version")) if isinstance(raw, dict) else "not an object"
            raise ValueError(f"not a {FORMAT} v{FORMAT_VERSION} file: format and version are {found}")
        node, law = raw["node"], raw.get("law")
        if not isinstance(node, dict) or not (law is None or isinstance(law, dict)):
            raise ValueError("node and law must be objects")
        values = [float(node[k]) for k in ("a", "b", "c")] + [float(node.get(k, 0.0)) for k in ("d", "surprisal_mean")]
        values += [float(law["b0"]), float(law["b1"])] if law else []
        if not all(math.isfinite(v) for v in values) or values[1] < 0 or values[3] > 0:
            raise ValueError("coefficients must be finite, with b >= 0 and d <= 0")
        return cls(*values[:4], law=(values[5], values[6]) if law else None, surprisal_mean=values[4],
                   fitted_on=dict(raw.get("fitted_on") or {}))

    def save(self, path: Path) -> None:
        try:
            write_file(path, json.dumps(self.as_dict(), indent=1) + "\n")
        except OSError as exc:
            raise GlanceError(f"cannot write {path} ({exc.strerror}); pick a writable --out") from None


PRIOR = Calibration()


def load_calibration(path: Path) -> Calibration:
    """The calibration in `path`; anything else (unreadable, not strict JSON, foreign, out of range) is one line."""
    text = read_text(path, "calibration", "pass an existing calibration file")  # typed and sized: a FIFO is named
    try:
        return Calibration.from_dict(parse(text))
    except (ValueError, KeyError, TypeError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise GlanceError(f"{path} is not a usable calibration ({reason}); {REFIT}") from None


def find_calibration(places: list[Path | None]) -> tuple[Calibration, Path | None]:
    """The first `calibration.json` among `places` (the artifacts, engines or head directories), else the prior."""
    for place in places:
        if place is not None and present(Path(place) / FILE, "calibration", REFIT):
            return load_calibration(Path(place) / FILE), Path(place) / FILE
    return PRIOR, None
