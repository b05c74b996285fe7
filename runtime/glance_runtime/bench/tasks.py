"""Task files for the bench: TASKS.jsonl lines `{"prompt", "image"?, "kind"?}`, images relative to the file.

Read here, not through glance_export.audit, because the bench must run without torch. A row's
`kind` names its task kind; without one, the file's directory name does (examples/receipt/...).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import GlanceError


@dataclass(frozen=True)
class Task:
    kind: str
    index: int  # position within its kind
    prompt: str
    image: Path | None


def read_tasks(paths: list[Path], limit: int | None = None) -> list[Task]:
    """Every file's first `limit` prompts, in file order; a kind seen in two files continues its numbering."""
    tasks: list[Task] = []
    counts: dict[str, int] = {}
    for path in paths:
        if not path.is_file():
            raise GlanceError(f"task file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise GlanceError(f"task file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
        taken = 0
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if limit is not None and taken >= limit:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GlanceError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise GlanceError(f"{path}:{lineno} needs a string \"prompt\" field")
            image = path.parent / row["image"] if row.get("image") else None
            if image is not None and not image.is_file():
                raise GlanceError(f"{path}:{lineno}: image {image} does not exist")
            kind = str(row.get("kind") or path.parent.name or "tasks")
            tasks.append(Task(kind, counts.get(kind, 0), row["prompt"], image))
            counts[kind] = counts.get(kind, 0) + 1
            taken += 1
        if taken == 0:
            raise GlanceError(f"task file {path} holds no prompts; add one {{\"prompt\": ...}} per line")
    return tasks
