"""TASKS.jsonl for the commands that take one (audit, train-head): `{"prompt": str, "image": path}` per
line, the image path relative to the file. Every refusal names the file, the line and the fix."""
from __future__ import annotations

import json
from pathlib import Path

from glance_runtime.errors import GlanceError

from .audit import Task

FORMAT = 'one {"prompt": "...", "image": "relative/path.png"} object per line'


def read_tasks(path: str | Path) -> list[Task]:
    """The tasks of `path`, in file order; a file with none is refused."""
    path = Path(path)
    if not path.is_file():
        raise GlanceError(f"task file {path} does not exist; pass a TASKS.jsonl file (`glance-export corpus` writes "
                          "them)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise GlanceError(f"{path}:{line} is not valid UTF-8; save the task file as UTF-8") from None
    tasks = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GlanceError(f"{path}:{lineno} is not valid JSON ({exc.msg}); write {FORMAT}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise GlanceError(f"{path}:{lineno} needs a string \"prompt\" field; write {FORMAT}")
        image = row.get("image")
        tasks.append(Task(row["prompt"], path.parent / image if image else None))
    if not tasks:
        raise GlanceError(f"{path} has no tasks; write {FORMAT}")
    return tasks
