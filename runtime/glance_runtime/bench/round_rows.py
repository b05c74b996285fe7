"""The round log's rows from measured runs, and the rounds `glance-bench calibrate` fits auto's calibration to;
the file itself is `glance_runtime.formats.rounds`."""
from __future__ import annotations

from ..errors import GlanceError
from .measure import PromptResult


def round_rows(results: list[PromptResult]) -> list[dict]:
    rows = []
    for r in results:
        for run in r.runs:
            for i, rd in enumerate(run.rounds):
                rows.append({"kind": r.task.kind, "prompt": r.task.index, "mode": run.mode, "sample": run.sample,
                             "round": i, **{k: _compact(v) for k, v in rd.items()}})
    return rows


def _compact(value):
    """Floats to 4 decimals, inside lists too (a tree's node scores), so the log stays small."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


def calibration_rows(rows: list[dict], modes: list[str] | None, source: str) -> list[dict]:
    """The rounds auto's calibration is fitted to: those of `modes` (default: every fixed tree mode,
    tree-N), each prompt's first kept sample only (later ones repeat it)."""
    if not any("node_scores" in row for row in rows):
        raise GlanceError(f"{source} has no node scores (an older glance-bench wrote it); rerun glance-bench "
                          "with this version")
    present = sorted({str(row.get("mode")) for row in rows})
    if modes is None:
        modes = [m for m in present if m.startswith("tree-")]
        if not modes:
            raise GlanceError(f"{source} has no fixed tree rounds; pass --mode, one of: {', '.join(present)}")
    unknown = [m for m in modes if m not in present]
    if unknown:
        raise GlanceError(f"mode {unknown[0]!r} is not in {source}; it has: {', '.join(present)}")
    chosen = [row for row in rows if str(row.get("mode")) in modes]
    first: dict[tuple, int] = {}
    for row in chosen:
        first[_run_of(row)] = min(first.get(_run_of(row), row.get("sample", 0)), row.get("sample", 0))
    return [row for row in chosen if row.get("sample", 0) == first[_run_of(row)]]


def _run_of(row: dict) -> tuple:
    return row.get("kind"), row.get("prompt"), row.get("mode")
