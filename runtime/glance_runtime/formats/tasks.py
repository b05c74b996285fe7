"""TASKS.jsonl, the one task-file format every command reads (audit, eval, train-head, glance-bench, drift):
one object per line, `{"prompt": str, "image": path, "kind": str, "answer": str, "answers": [str]}`, all
but the prompt optional, the image path relative to the file. Written by hand as often as by
`glance-export corpus`, so its rows carry no version: VERSION names this set of fields, and a field of
the wrong type (a number as a path, a lone surrogate, a nested value) is refused with the file, the line
and the fix. Torch-free, so the edge commands read it too."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..store.atomic import write_file
from ..errors import GlanceError
from .common import Invalid, check_text, optional_text, read_jsonl

FORMAT = "glance-tasks"
VERSION = 1
SHAPE = 'one {"prompt": "...", "image": "relative/path.png"} object per line'
FIX = f"write {SHAPE} (`glance-export corpus` writes them)"


@dataclass(frozen=True)
class Task:
    prompt: str
    image: Path | None = None
    kind: str | None = None  # the row's task kind, where it names one
    answer: str | None = None  # the reference answer, where the row gives one
    answers: tuple[str, ...] = ()  # every accepted answer (eval scores against them): `answers`, else `answer`


def parse_row(row: dict[str, Any], base: Path) -> Task:
    """One line's object as a Task (image resolved against `base`); Invalid names the bad field."""
    if "prompt" not in row:
        raise Invalid('the "prompt" field is missing')
    prompt = check_text(row["prompt"], '"prompt"')
    image = optional_text(row, "image", name='"image"')
    if image is not None and "\x00" in image:
        raise Invalid('"image" holds a NUL character, which no path can')
    answer, answers = optional_text(row, "answer", name='"answer"'), row.get("answers")
    if answers is None:
        answers = [] if answer is None else [answer]
    elif not isinstance(answers, list):
        raise Invalid('"answers" must be a list of strings')
    return Task(prompt, base / image if image else None, optional_text(row, "kind", name='"kind"') or None, answer,
                tuple(check_text(a, f'"answers"[{i}]') for i, a in enumerate(answers)))


def read(path: str | Path, need_answers: bool = False) -> list[Task]:
    """The tasks of `path`, in file order; a file with none is refused, and with `need_answers` so is a
    row without an answer."""
    path = Path(path)
    tasks = []
    for lineno, row in read_jsonl(path, "task file", FIX):
        try:
            task = parse_row(row, path.parent)
        except Invalid as exc:
            raise GlanceError(f"{path}:{lineno}: {exc}; {FIX}") from None
        if need_answers and not task.answers:
            raise GlanceError(f'{path}:{lineno} has no "answer"; scoring needs one per row: add "answer": "..." '
                              f"(or write the file with `glance-export corpus`)")
        tasks.append(task)
    if not tasks:
        raise GlanceError(f"task file {path} has no tasks; {FIX}")
    return tasks


def row(task: Task, base: Path) -> dict[str, Any]:
    """A task as its line's object, the image relative to `base` where it lies under it."""
    out: dict[str, Any] = {"prompt": task.prompt}
    if task.image is not None:
        image = Path(task.image)
        out["image"] = str(image.relative_to(base)) if image.is_relative_to(base) else str(image)
    if task.kind is not None:
        out["kind"] = task.kind
    if task.answer is not None:
        out["answer"] = task.answer
    if task.answers and list(task.answers) != [task.answer]:
        out["answers"] = list(task.answers)
    return out


def write(path: str | Path, tasks: list[Task]) -> Path:
    """Whole or not at all (temp file, then rename)."""
    path = Path(path)
    write_file(path, "".join(json.dumps(row(t, path.parent)) + "\n" for t in tasks))
    return path
