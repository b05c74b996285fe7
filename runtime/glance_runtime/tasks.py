"""TASKS.jsonl, the one task-file format every command reads (audit, train-head, glance-bench, drift):
`{"prompt": str, "image": path, "kind": str}` per line, image and kind optional, the image path
relative to the file. Torch-free, so the edge commands read it too; every refusal names the file,
the line and the fix."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import GlanceError
from .jsonl import read_jsonl

FORMAT = 'one {"prompt": "...", "image": "relative/path.png"} object per line'


@dataclass(frozen=True)
class Task:
    prompt: str
    image: Path | None = None
    kind: str | None = None  # the row's task kind, where it names one


def read_tasks(path: str | Path) -> list[Task]:
    """The tasks of `path`, in file order; a file with none is refused."""
    path = Path(path)
    tasks = []
    for lineno, row in read_jsonl(path, "task file", f"write {FORMAT} (`glance-export corpus` writes them)"):
        if not isinstance(row.get("prompt"), str):
            raise GlanceError(f"{path}:{lineno} needs a string \"prompt\" field; write {FORMAT}")
        image, kind = row.get("image"), row.get("kind")
        tasks.append(Task(row["prompt"], path.parent / image if image else None, str(kind) if kind else None))
    if not tasks:
        raise GlanceError(f"{path} has no tasks; write {FORMAT}")
    return tasks
