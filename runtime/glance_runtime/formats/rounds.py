"""rounds.jsonl, glance-bench's round log: one object per round of every kept run (kind, prompt, mode,
sample, round, anchor entropy, accepted length, tree size, cap, timings, and for calibration whether the
round drafted, the anchor's surprisal, the verified nodes' path scores and depths and the accepted path).
Its rows carry no version (the report.json beside it records the toolkit that wrote it), since
`glance-bench law` also reads any JSON lines with a finite "entropy" and an "accepted" count >= 1 per
round; VERSION names this set of fields, and every row is checked for them on read."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..store.atomic import write_file
from ..errors import GlanceError
from .common import read_jsonl

FORMAT = "glance-rounds"
VERSION = 1
FIX = "pass rounds.jsonl from glance-bench"


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _number(value: Any) -> bool:
    """Any number but NaN: a log-probability or surprisal may be infinite where a probability underflowed."""
    return type(value) in (int, float) and not math.isnan(value)


def _numbers(value: Any) -> bool:
    return isinstance(value, list) and all(_number(v) for v in value)


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(_count(v) for v in value)


# The optional fields the law and the calibration group, filter and fit by, and what each must be when
# present; null stands for absent except where a number is compared (sample, cap).
OPTIONAL = {"mode": (lambda v: isinstance(v, str), "a string"),
            "kind": (lambda v: isinstance(v, str), "a string"),
            "prompt": (lambda v: _count(v) or isinstance(v, str), "a prompt number or string"),
            "final": (lambda v: type(v) is bool, "true or false"),
            "drafted": (lambda v: type(v) is bool, "true or false"),
            "surprisal": (_number, "a number"),
            "node_scores": (_numbers, "a list of numbers"),
            "node_depths": (_counts, "a list of depths (0, 1, ...)"),
            "path": (_counts, "a list of node numbers")}
REQUIRED_IF_PRESENT = {"sample": (_count, "a sample number (0, 1, ...)"),
                       "cap": (_count, "a whole number of drafted tokens")}


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    try:
        write_file(path, "".join(json.dumps(row) + "\n" for row in rows))
    except OSError as exc:
        raise GlanceError(f"cannot write {path} ({exc.strerror}); pick a writable --out") from None


def read(path: Path) -> list[dict[str, Any]]:
    """Every round of the log, each with a finite entropy and an accepted length of at least 1."""
    rows = []
    for lineno, row in read_jsonl(path, "round log", FIX, allow_nan=True):
        if not (_finite(row.get("entropy")) and _finite(row.get("accepted")) and row["accepted"] >= 1):
            raise GlanceError(f"{path}:{lineno} needs a finite numeric \"entropy\" and an \"accepted\" count of at "
                              f"least 1; {FIX}")
        checks = [(k, c) for k, c in OPTIONAL.items() if row.get(k) is not None]
        for key, (ok, what) in [*checks, *((k, c) for k, c in REQUIRED_IF_PRESENT.items() if k in row)]:
            if not ok(row[key]):
                raise GlanceError(f"{path}:{lineno} has \"{key}\": {str(row[key])[:40]!r}, which is not {what}; {FIX}")
        rows.append(row)
    if not rows:
        raise GlanceError(f"round log {path} holds no rounds; {FIX}")
    return rows
