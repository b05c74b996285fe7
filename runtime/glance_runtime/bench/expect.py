"""`glance-bench --expect`: the user's own pass/fail thresholds on the report's figures.

A report states measurements only; what counts as good enough depends on the device, the model and the
task mix, so the thresholds come from whoever runs the bench (a CI gate, a regression check). An
expectation is `METRIC[@SCOPE] OP NUMBER`, e.g. `speedup>=1.5`, `speedup@receipt>=2`, `law_slope<0`;
without a scope it must hold for every task kind and for the pooled figure.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Callable

from ..errors import GlanceError
from .law_log import POOLED

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}


def _scopes(report: dict) -> dict[str, dict]:
    return {**report["kinds"], POOLED: report["pooled"]}


def _best(field: str) -> Callable[[dict], dict[str, float]]:
    def values(report: dict) -> dict[str, float]:
        return {k: s["modes"][s["best"]][field] for k, s in _scopes(report).items()}
    return values


def _tree_vs_chain(report: dict) -> dict[str, float]:
    """The smallest ratio over the budgets both ran (so a threshold holds at every budget)."""
    return {k: min(v.values()) for k, v in report["tree_vs_chain"].items() if v}


def _law_slope(report: dict) -> dict[str, float]:
    return {k: math.nan if fit["b1"] is None else -fit["b1"] for k, fit in report["law"].items()}


def _identical(report: dict) -> dict[str, float]:
    runs = report["lossless"]["runs"]
    return {POOLED: report["lossless"]["identical"] / runs if runs else math.nan}


def _auto(section: str, field: str) -> Callable[[dict], dict[str, float]]:
    def values(report: dict) -> dict[str, float]:
        return {k: v[field] for k, v in report["auto"][section].items()}
    return values


@dataclass(frozen=True)
class Metric:
    describe: str
    values: Callable[[dict], dict[str, float]]
    needs: str | None = None  # what --budgets/--chain must include for the metric to exist


METRICS: dict[str, Metric] = {
    "speedup": Metric("the best mode's speedup over AR, excluding prefill", _best("speedup_decode")),
    "speedup_with_prefill": Metric("the best mode's speedup over AR, including prefill",
                                   _best("speedup_with_prefill")),
    "tau": Metric("the best mode's tokens per round", _best("tau")),
    "tree_vs_chain": Metric("tree tau over chain tau at equal rows verified (smallest over budgets)",
                            _tree_vs_chain, needs="chain"),
    "law_slope": Metric("the draftability law's slope -b1 (negative: acceptance falls with entropy)", _law_slope),
    "identical": Metric("share of runs identical to AR greedy (pooled)", _identical),
    "auto_vs_best": Metric("auto's ms/token over the best fixed tree's, excluding prefill",
                           _auto("vs_best_fixed", "ratio"), needs="auto"),
    "auto_over_largest": Metric("auto's speedup over the largest fixed tree, excluding prefill",
                                _auto("vs_largest_tree", "speedup"), needs="auto"),
}

_PATTERN = re.compile(r"^\s*([a-z_]+)(?:@([\w.-]+))?\s*(>=|<=|==|>|<)\s*([-+]?[\d.]+(?:e[-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Expectation:
    text: str
    metric: str
    scope: str | None
    op: str
    threshold: float

    def judge(self, report: dict) -> dict:
        """{expect, met, values}: met when the threshold holds for every value in scope (and one exists)."""
        values = METRICS[self.metric].values(report)
        if self.scope is not None:
            values = {self.scope: values[self.scope]} if self.scope in values else {}
        finite = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        met = bool(finite) and len(finite) == len(values) and all(
            OPERATORS[self.op](v, self.threshold) for v in finite.values())
        return {"expect": self.text, "met": met, "values": values}


def parse(text: str, available: set[str]) -> Expectation:
    """One `--expect` value, refused in one line when it names no metric or one this run will not measure
    (`available`: "auto" and/or "chain", from the run's settings)."""
    match = _PATTERN.match(text)
    if not match:
        raise GlanceError(f"--expect {text!r} is not METRIC[@KIND] OP NUMBER; e.g. --expect speedup>=1.5 "
                          f"(metrics: {', '.join(METRICS)})")
    name, scope, op, number = match.groups()
    if name not in METRICS:
        raise GlanceError(f"--expect {text!r}: unknown metric {name!r}; use one of {', '.join(METRICS)}")
    needs = METRICS[name].needs
    if needs is not None and needs not in available:
        flag = "--chain" if needs == "chain" else "auto in --budgets"
        raise GlanceError(f"--expect {text!r}: {name} is measured only with {flag}; add it or drop the expectation")
    return Expectation(text.strip(), name, scope, op, float(number))


def judge_all(expectations: list[Expectation], report: dict) -> list[dict]:
    """Each expectation judged; one naming a task kind the run did not have is refused."""
    scopes = set(_scopes(report))
    for e in expectations:
        if e.scope is not None and e.scope not in scopes:
            raise GlanceError(f"--expect {e.text!r}: this run has no kind {e.scope!r}; use one of "
                              f"{', '.join(sorted(scopes))}")
    return [e.judge(report) for e in expectations]


def line(result: dict) -> str:
    """`met: speedup>=1.5 (receipt 2.11, pooled 1.92)`."""
    values = ", ".join(f"{k} {v:.3g}" if v is not None and math.isfinite(v) else f"{k} n/a"
                       for k, v in result["values"].items())
    return f"{'met' if result['met'] else 'NOT met'}: {result['expect']} ({values or 'no value'})"
