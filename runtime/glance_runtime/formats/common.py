"""Reading JSON documents and JSON-lines files so that any bytes at all end in a value or one GlanceError
line: missing, a directory, unreadable, not UTF-8, not JSON (NaN and Infinity included), nested too deeply,
not an object, another format or version. Field checks raise `Invalid`, which a format's reader turns into
its one line with the file's name and fix."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable

from ..errors import GlanceError
from ..store.input_files import read_bytes

MAX_DEPTH = 64  # no format nests deeper; anything deeper is refused before it is walked
MAX_DOCUMENT_BYTES = 1 << 30  # a manifest, profile, task file or round log is far smaller
MAX_BATCH = 4096  # limits.max_batch of an export or a build: sequences a batched round may run at most


class Invalid(ValueError):
    """A field with a wrong type or value; the message names the field and what it must be."""


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse(text: str, allow_nan: bool = False) -> Any:
    """JSON nested no deeper than MAX_DEPTH, and without NaN or Infinity unless `allow_nan` (files whose
    free-form fields may carry them). ValueError on anything else."""
    try:
        value = json.loads(text, **({} if allow_nan else {"parse_constant": _no_constant}))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at line {exc.lineno}") from None
    if _depth(value) > MAX_DEPTH:
        raise ValueError("nested too deeply")
    return value


def _depth(value: Any) -> int:
    """Nesting depth, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_text(path: Path, what: str, fix: str) -> str:
    """The file as text, or one line saying why it cannot be (the real cause: a directory is a directory, a
    FIFO a FIFO; a file larger than any document of ours is not read)."""
    path = Path(path)
    raw = read_bytes(path, what, fix, MAX_DOCUMENT_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise GlanceError(f"{path}:{line} is not valid UTF-8; save the {what} as UTF-8") from None


def read_json(path: Path, what: str, fix: str, allow_nan: bool = False) -> dict[str, Any]:
    """A JSON object file."""
    text = read_text(path, what, fix)
    try:
        raw = parse(text, allow_nan)
    except ValueError as exc:
        raise GlanceError(f"{what} {path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(raw, dict):
        raise GlanceError(f"{what} {path} holds a JSON {_kind(raw)}, not an object; {fix}")
    return raw


def read_jsonl(path: Path, what: str, fix: str, allow_nan: bool = False) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; BOM and CRLF are fine."""
    rows = []
    for lineno, line in enumerate(read_text(path, what, fix).lstrip("\ufeff").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = parse(line, allow_nan)
        except ValueError as exc:
            raise GlanceError(f"{path}:{lineno} is not valid JSON ({exc}); {fix}") from None
        if not isinstance(row, dict):
            raise GlanceError(f"{path}:{lineno} is a JSON {_kind(row)}, not an object; {fix}")
        rows.append((lineno, row))
    return rows


def _kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def check_header(raw: dict[str, Any], path: Path, what: str, fmt: str, version: int, fix: str) -> None:
    """`format` and `format_version` are exactly this reader's."""
    found, found_version = raw.get("format"), raw.get("format_version")
    if found != fmt:
        named = f"format {found!r}" if "format" in raw else "no \"format\" field"
        raise GlanceError(f"{path} is not a {what} (it has {named}, a {what} has {fmt!r}); {fix}")
    if type(found_version) is not int:
        raise GlanceError(f"{path} has format_version {found_version!r}, which is not an integer; {fix}")
    if found_version != version:
        age = "an older" if found_version < version else "a newer"
        raise GlanceError(f"{path} is {fmt} format v{found_version}, {age} format than the v{version} this "
                          f"toolkit reads; {fix}")


def digest(document: dict[str, Any], *, leave_out: str) -> str:
    """sha256 of a document's canonical JSON without the field that stores it."""
    body = {k: v for k, v in document.items() if k != leave_out}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def stamped(document: dict[str, Any], fmt: str, version: int, hash_field: str | None = None) -> dict[str, Any]:
    """The document under this format's header (first), with its content hash (last) where it keeps one."""
    header = {"format": fmt, "format_version": version}
    body = {**header, **{k: v for k, v in document.items() if k not in header and k != hash_field}}
    return {**body, hash_field: digest(body, leave_out=hash_field)} if hash_field else body


def dumps(document: dict[str, Any], indent: int = 1) -> str:
    return json.dumps(document, indent=indent, allow_nan=False) + "\n"


# Field checks: each returns the value, typed, or raises Invalid naming the field.

def field(raw: dict[str, Any], key: str, where: str = "") -> Any:
    if not isinstance(raw, dict):
        raise Invalid(f"{where or 'the document'} must be an object")
    if key not in raw:
        raise Invalid(f"{where}{key} is missing")
    return raw[key]


def obj(raw: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    value = field(raw, key, where)
    if not isinstance(value, dict):
        raise Invalid(f"{where}{key} must be an object")
    return value


def integer(raw: dict[str, Any], key: str, lo: int, hi: int, where: str = "") -> int:
    return check_int(field(raw, key, where), f"{where}{key}", lo, hi)


def check_int(value: Any, name: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise Invalid(f"{name} is {_short(value)}; it must be an integer in {lo}..{hi}")
    return value


def optional_int(raw: dict[str, Any], key: str, lo: int, hi: int, where: str = "") -> int | None:
    value = raw.get(key) if isinstance(raw, dict) else None
    return None if value is None else check_int(value, f"{where}{key}", lo, hi)


def number(raw: dict[str, Any], key: str, where: str = "", positive: bool = False) -> float:
    value = field(raw, key, where)
    if type(value) not in (int, float) or not math.isfinite(value) or (positive and value <= 0):
        raise Invalid(f"{where}{key} is {_short(value)}; it must be a finite{' positive' if positive else ''} number")
    return float(value)


def text(raw: dict[str, Any], key: str, where: str = "", choices: tuple[str, ...] = ()) -> str:
    return check_text(field(raw, key, where), f"{where}{key}", choices)


def check_text(value: Any, name: str, choices: tuple[str, ...] = ()) -> str:
    if not isinstance(value, str):
        raise Invalid(f"{name} is {_short(value)}; it must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid(f"{name} holds a lone surrogate (\\ud800-\\udfff escape), which is not text") from None
    if choices and value not in choices:
        raise Invalid(f"{name} is {_short(value)}; it must be one of {', '.join(choices)}")
    return value


def optional_text(raw: dict[str, Any], key: str, where: str = "", name: str | None = None) -> str | None:
    """`raw[key]` as text, None where it is absent or null; a refusal names it `name` (default: where + key)."""
    value = raw.get(key)
    return None if value is None else check_text(value, name or f"{where}{key}")


def boolean(raw: dict[str, Any], key: str, where: str = "") -> bool:
    value = field(raw, key, where)
    if type(value) is not bool:
        raise Invalid(f"{where}{key} is {_short(value)}; it must be true or false")
    return value


def int_list(raw: dict[str, Any], key: str, lo: int, hi: int, where: str = "") -> tuple[int, ...]:
    value = field(raw, key, where)
    if not isinstance(value, list):
        raise Invalid(f"{where}{key} must be a list of integers in {lo}..{hi}")
    return tuple(check_int(v, f"{where}{key}[{i}]", lo, hi) for i, v in enumerate(value))


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def guarded(path: Path, fix: str, build: Callable[[], Any]) -> Any:
    """Run a schema's field checks; an `Invalid` becomes one line naming the file and the fix."""
    try:
        return build()
    except Invalid as exc:
        raise GlanceError(f"{path}: {exc}; {fix}") from None
