"""rounds.jsonl: one line per round of every kept run (kind, prompt, mode, sample, anchor entropy,
accepted length, tree size, cap, draft/verify/outside ms and each graph's ms where timed)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import GlanceError
from ..jsonl import read_jsonl
from .measure import PromptResult

REQUIRED = ("entropy", "accepted")


def round_rows(results: list[PromptResult]) -> list[dict]:
    rows = []
    for r in results:
        for run in r.runs:
            for i, rd in enumerate(run.rounds):
                rows.append({"kind": r.task.kind, "prompt": r.task.index, "mode": run.mode, "sample": run.sample,
                             "round": i, **{k: round(v, 4) if isinstance(v, float) else v for k, v in rd.items()}})
    return rows


def write_rounds(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def read_rounds(path: Path) -> list[dict]:
    """A round log from `glance-bench` (or any JSON lines with entropy and accepted per round)."""
    fix = "pass rounds.jsonl from glance-bench"
    rows = []
    for lineno, row in read_jsonl(path, "round log", fix):
        if any(not isinstance(row.get(k), (int, float)) for k in REQUIRED):
            raise GlanceError(f"{path}:{lineno} needs numeric \"entropy\" and \"accepted\" fields; {fix}")
        rows.append(row)
    if not rows:
        raise GlanceError(f"round log {path} holds no rounds; {fix}")
    return rows
