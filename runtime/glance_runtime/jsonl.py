"""JSON-lines input files (task files, round logs): one reader, so every such file is refused the same way:
missing, not UTF-8, a line that is not a JSON object; each error names the file, the line and the fix."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import GlanceError


def read_jsonl(path: str | Path, what: str, fix: str) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line of `path`; `what` names the file in errors ("task
    file"), `fix` says what to write instead."""
    path = Path(path)
    if not path.is_file():
        raise GlanceError(f"{what} {path} does not exist; {fix}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise GlanceError(f"{path}:{line} is not valid UTF-8; save the {what} as UTF-8") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GlanceError(f"{path}:{lineno} is not valid JSON ({exc.msg}); {fix}") from None
        if not isinstance(row, dict):
            raise GlanceError(f"{path}:{lineno} is not a JSON object; {fix}")
        rows.append((lineno, row))
    return rows
