"""The bench's prompts: task files (`glance_runtime.formats.tasks`), each prompt tagged with its kind and
its number within the kind. A row's `kind` names the kind; without one, the file's directory name does
(examples/receipt/...)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import GlanceError
from ..formats import tasks as task_file


@dataclass(frozen=True)
class BenchTask:
    kind: str
    index: int  # position within its kind
    prompt: str
    image: Path | None


def read_bench_tasks(paths: list[Path], limit: int | None = None) -> list[BenchTask]:
    """Every file's first `limit` prompts, in file order; a kind seen in two files continues its numbering.
    Images are checked here, before any measuring starts."""
    tasks: list[BenchTask] = []
    counts: dict[str, int] = {}
    for path in paths:
        for row in task_file.read(path)[:limit]:
            if row.image is not None and not row.image.is_file():
                what = "is a directory" if row.image.is_dir() else "does not exist"
                raise GlanceError(f"{path}: image {row.image} {what}; fix the task file's \"image\" path")
            kind = row.kind or Path(path).parent.name or "tasks"
            tasks.append(BenchTask(kind, counts.get(kind, 0), row.prompt, row.image))
            counts[kind] = counts.get(kind, 0) + 1
    return tasks
