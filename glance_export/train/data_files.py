"""Training conversations from the files users have: TASKS.jsonl, LLaVA-style JSON or JSONL, and OpenAI-style
`{"messages": [...]}` JSONL, several images and turns a row, image paths relative to the data file.

Each row becomes OpenAI-style messages (the runtime's prompt builder renders them). The head learns the
target's own answers, so a row yields one sample per assistant turn: the conversation before that turn, as
written, which the target answers afresh; a row without an assistant turn yields its whole conversation. A
row that cannot be used is counted with its reason, not fatal, unless too many are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from glance_runtime.errors import GlanceError
from glance_runtime.formats.common import Invalid
from glance_runtime.formats.tasks import parse_row as parse_task_row
from glance_runtime.prompt.messages import user_turn
from glance_runtime.store.input_files import read_bytes, regular_file

IMAGE_MARK = "<image>"
LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MAX_BAD_FRACTION = 0.10
SHOWN_REASONS = 3
MAX_FILE_BYTES = 4 << 30  # a data file is parsed in memory; the largest public instruction sets are ~1 GB
FILE_FIX = "pass a TASKS.jsonl, LLaVA JSON/JSONL or OpenAI messages JSONL file"


@dataclass(frozen=True)
class Sample:
    messages: list[dict[str, Any]]  # the conversation the target answers, ending with a user turn
    where: str  # file:line, for messages about the row


@dataclass
class Tally:
    """Rows read and rows skipped, with the first few reasons, for the summary line."""
    rows: int = 0
    bad_rows: set[str] = field(default_factory=set)  # a row is bad once, however many of its turns fail
    reasons: list[str] = field(default_factory=list)

    @property
    def bad(self) -> int:
        return len(self.bad_rows)

    def skip(self, where: str, reason: str) -> None:
        if where not in self.bad_rows and len(self.reasons) < SHOWN_REASONS:
            self.reasons.append(f"{where}: {reason}")
        self.bad_rows.add(where)

    def summary(self) -> str:
        line = f"read {self.rows} rows, skipped {self.bad}"
        return line + (f" ({'; '.join(self.reasons)})" if self.reasons else "")

    def check(self) -> None:
        """Refuse data where more than a tenth of the rows are unusable: a wrong path or format, not noise."""
        if self.rows and self.bad > MAX_BAD_FRACTION * self.rows:
            raise GlanceError(f"{self.bad} of {self.rows} training rows cannot be used (first: "
                              f"{'; '.join(self.reasons)}); fix the data files or their image paths")


def _image_path(value: Any, base: Path) -> str:
    """A local image path resolved against the data file's folder; URLs are refused (nothing is downloaded)."""
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise Invalid("an image must be a path string")
    if value.startswith("file://"):
        value = value[len("file://"):]
    elif "://" in value or value.startswith("data:"):
        raise Invalid(f"image {value[:60]!r} is not a local path (nothing is downloaded)")
    path = base / value
    if not path.is_file():
        raise Invalid(f"image {path} does not exist")
    return str(path)


def _llava(row: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    """`image` (a path or a list) and `conversations` of {"from", "value"} turns with `<image>` markers; images
    without markers go before the first human turn's text, as LLaVA data does."""
    images = row.get("image", [])
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list):
        raise Invalid('"image" must be a path or a list of paths')
    paths = [_image_path(im, base) for im in images]
    turns = row["conversations"]
    if not isinstance(turns, list):
        raise Invalid('"conversations" must be a list of turns')
    marks = sum(t.get("value", "").count(IMAGE_MARK) for t in turns if isinstance(t, dict)
                and isinstance(t.get("value"), str))
    if marks not in (0, len(paths)):
        raise Invalid(f"{marks} {IMAGE_MARK} markers for {len(paths)} images")
    pending = iter(paths)
    messages = []
    for turn in turns:
        role = LLAVA_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        text = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(text, str):
            raise Invalid(f'a turn must be {{"from": "human"|"gpt"|"system", "value": str}}; got {turn!r:.60}')
        if role != "user":
            messages.append({"role": role, "content": text})
            continue
        if not marks and paths and not any(m["role"] == "user" for m in messages):
            messages.append(user_turn(text.strip(), [next(pending) for _ in paths]))
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(text.split(IMAGE_MARK)):
            if i:
                parts.append({"type": "image", "image": next(pending)})
            if piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        messages.append({"role": "user", "content": parts})
    return messages


def _openai(row: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    """`messages` with content strings or parts; image parts as {"type": "image", "image": path} or
    {"type": "image_url", "image_url": {"url": path}}, paths local."""
    messages = row["messages"]
    if not isinstance(messages, list):
        raise Invalid('"messages" must be a list')
    out = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise Invalid(f"a message must be an object; got {msg!r:.60}")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image", "image_url"):
                    parts.append({"type": "image", "image": _image_path(part.get(kind), base)})
                else:
                    parts.append(part)
            content = parts
        out.append({"role": msg.get("role"), "content": content})
    return out


def _task(row: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    task = parse_task_row(row, base)
    if task.image is not None and not Path(task.image).is_file():
        raise Invalid(f"image {task.image} does not exist")
    return [user_turn(task.prompt, [str(task.image)] if task.image is not None else [])]


def _conversation(row: Any, base: Path) -> list[dict[str, Any]]:
    if not isinstance(row, dict):
        raise Invalid("a row must be a JSON object")
    if "messages" in row:
        return _openai(row, base)
    if "conversations" in row:
        return _llava(row, base)
    if "prompt" in row:
        return _task(row, base)
    raise Invalid('a row needs "messages" (OpenAI), "conversations" (LLaVA) or "prompt" (TASKS.jsonl)')


def check_files(paths: list[Path], what: str) -> None:
    """Refuse, before any work, a data file that is missing, a dangling link, a directory, a FIFO or a device."""
    for path in paths:
        regular_file(path, what, FILE_FIX)


def _parse(text: str) -> Any:
    """One JSON value whose strings are all encodable (a lone surrogate is valid JSON, but no tokenizer takes it)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise Invalid("nested too deeply to be a training row") from None
    except json.JSONDecodeError as exc:
        raise Invalid(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Invalid(f"holds a lone surrogate ({exc.object[exc.start:exc.end]!r}), which is not text") from None
    except RecursionError:
        raise Invalid("nested too deeply to be a training row") from None
    return value


def _rows(path: Path, what: str) -> Iterator[tuple[str, Any]]:
    """(file:line, parsed row or the parse error) of a JSONL file, or of a JSON file holding a list of rows."""
    raw = read_bytes(path, what, FILE_FIX, MAX_FILE_BYTES)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise GlanceError(f"{what} {path}:{line} is not UTF-8; save it as UTF-8") from None
    if path.suffix == ".json":
        try:
            rows = _parse(text)
        except Invalid as exc:
            raise GlanceError(f"{what} {path} is not usable JSON ({exc}); pass a JSON list of rows or a JSONL "
                              "file") from None
        if not isinstance(rows, list):
            raise GlanceError(f"{path} holds no list of rows; a .json data file is a list of LLaVA-style rows")
        for i, row in enumerate(rows):
            yield f"{path}[{i}]", row
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield f"{path}:{lineno}", _parse(line)
            except Invalid as exc:
                yield f"{path}:{lineno}", exc


def samples_of(messages: list[dict[str, Any]], where: str) -> list[Sample]:
    """One sample per assistant turn (the conversation before it), or the whole conversation if it has none."""
    cuts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"] or [len(messages)]
    out = []
    for cut in cuts:
        before = messages[:cut]
        if not any(m.get("role") == "user" for m in before):
            raise Invalid("an assistant turn comes before any user turn" if cut < len(messages) else "no user turn")
        out.append(Sample(before, where))
    return out


def read_samples(paths: list[Path], tally: Tally, what: str = "training data") -> list[Sample]:
    """Every usable sample of `paths`, in file order; unusable rows are counted in `tally`."""
    out: list[Sample] = []
    for path in paths:
        path = Path(path)
        for where, row in _rows(path, what):
            tally.rows += 1
            try:
                if isinstance(row, Invalid):
                    raise row
                out.extend(samples_of(_conversation(row, path.parent), where))
            except Invalid as exc:
                tally.skip(where, str(exc))
    return out
