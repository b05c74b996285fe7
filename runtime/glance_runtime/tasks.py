"""TASKS.jsonl, the one task-file format every command reads (audit, train-head, glance-bench, drift):
`{"prompt": str, "image": path, "kind": str}` per line, image and kind optional, the image path
relative to the file. Torch-free, so the edge commands read it too; every refusal names the file,
the line and the fix."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import GlanceError

FORMAT = 'one {"prompt": "...", "image": "relative/path.png"} object per line'


@dataclass(frozen=True)
class Task:
    prompt: str
    image: Path | None = None
    kind: str | None = None  # the row's task kind, where it names one


def read_tasks(path: str | Path) -> list[Task]:
    """The tasks of `path`, in file order; a file with none is refused."""
    path = Path(path)
    if not path.is_file():
        raise GlanceError(f"task file {path} does not exist; pass a TASKS.jsonl file (`glance-export corpus` writes "
                          "them)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
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
        kind = row.get("kind")
        tasks.append(Task(row["prompt"], path.parent / image if image else None, str(kind) if kind else None))
    if not tasks:
        raise GlanceError(f"{path} has no tasks; write {FORMAT}")
    return tasks
