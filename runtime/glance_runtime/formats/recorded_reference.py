"""A recorded fp32 greedy reference (`glance-export audit --save-reference FILE`): written on a workstation
with torch, read on a device without it.

A Jetson has no PyTorch, so the oracle's tokens travel as a file, with the fp32 top-2 logit margin at
every step (what shows a reduced-precision divergence to be a near-tie, or not). The file names what it
was recorded for (the model's hashes as an artifacts manifest records them, the tasks, the settings) so
a mismatched use is refused in one line, and a checksum over its payload catches a damaged copy.

Document (format_version 1): format, format_version, payload_sha256 (of the payload's canonical JSON),
payload {source, tasks_sha256, max_new_tokens, stop_token_ids, toolkit_version, recorded_with,
tasks: [{prompt, image_sha256, input_ids_sha256, pixels_sha256, tokens, margins}]}.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..store.atomic import write_file
from ..errors import GlanceError
from .common import (Invalid, check_header, digest, dumps, guarded, int_list, integer,
                     optional_text, parse, read_text, stamped, text)

FORMAT = "glance-reference"
VERSION = 1
WHAT = "GLANCE reference file"
RECORD = "record it again with `glance-export audit --save-reference FILE --data TASKS.jsonl`"
HASH_FIELD = "payload_sha256"
MAX_ID = 1 << 24


@dataclass(frozen=True)
class RecordedTask:
    prompt: str
    image_sha256: str | None
    input_ids_sha256: str  # the prompt as token ids: a device that tokenizes differently is refused
    pixels_sha256: str | None  # preprocessed pixels; a difference is reported, not refused
    tokens: list[int]
    margins: list[float]  # fp32 top-1 minus top-2 logit at each generated token


@dataclass(frozen=True)
class Reference:
    source: dict[str, Any]  # {config_sha256, weights_sha256: {file: sha}}, as an artifacts manifest has it
    tasks_sha256: str
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    toolkit_version: str
    recorded_with: dict[str, str]  # torch and transformers versions, dtype
    tasks: tuple[RecordedTask, ...]


def _payload(ref: Reference) -> dict[str, Any]:
    body = asdict(ref)
    body["stop_token_ids"] = list(ref.stop_token_ids)
    body["tasks"] = [asdict(t) for t in ref.tasks]
    return body


def _task(i: int, raw: Any) -> RecordedTask:
    where = f"payload.tasks[{i}]."
    if not isinstance(raw, dict):
        raise Invalid(f"payload.tasks[{i}] must be an object")
    tokens, margins = int_list(raw, "tokens", 0, MAX_ID, where), raw.get("margins")
    if not isinstance(margins, list) or len(margins) != len(tokens) or \
            any(type(m) not in (int, float) or not math.isfinite(m) for m in margins):
        raise Invalid(f"{where}margins must hold one finite number per token")
    return RecordedTask(prompt=text(raw, "prompt", where), image_sha256=optional_text(raw, "image_sha256", where),
                        input_ids_sha256=text(raw, "input_ids_sha256", where),
                        pixels_sha256=optional_text(raw, "pixels_sha256", where),
                        tokens=list(tokens), margins=[float(m) for m in margins])


def _parse(payload: dict[str, Any]) -> Reference:
    source, recorded_with, tasks = payload.get("source"), payload.get("recorded_with"), payload.get("tasks")
    if not isinstance(source, dict) or not isinstance(recorded_with, dict) or not isinstance(tasks, list):
        raise Invalid("payload.source and payload.recorded_with must be objects, payload.tasks a list")
    return Reference(source=source, tasks_sha256=text(payload, "tasks_sha256", "payload."),
                     max_new_tokens=integer(payload, "max_new_tokens", 1, MAX_ID, "payload."),
                     stop_token_ids=int_list(payload, "stop_token_ids", 0, MAX_ID, "payload."),
                     toolkit_version=text(payload, "toolkit_version", "payload."),
                     recorded_with={str(k): str(v) for k, v in recorded_with.items()},
                     tasks=tuple(_task(i, t) for i, t in enumerate(tasks)))


def write(path: str | Path, ref: Reference) -> Path:
    """Written to a temporary sibling and renamed, so FILE is the old reference or the new one, never half."""
    path = Path(path)
    payload = _payload(ref)
    document = stamped({HASH_FIELD: digest(payload, leave_out=HASH_FIELD), "payload": payload}, FORMAT, VERSION)
    try:
        write_file(path, dumps(document))
    except OSError as exc:
        raise GlanceError(f"cannot write {path} ({exc.strerror}); pick a writable --save-reference path") from None
    return path


def read(path: str | Path) -> Reference:
    """Parse and verify FILE; anything unreadable, foreign, altered or malformed is one GlanceError."""
    path = Path(path)
    try:
        raw = parse(read_text(path, "reference", RECORD))
    except ValueError as exc:
        raise GlanceError(f"reference {path} is damaged or truncated ({exc}); copy it again or {RECORD}") from None
    if not isinstance(raw, dict):
        raise GlanceError(f"{path} is not a {WHAT} (not a JSON object); {RECORD}")
    check_header(raw, path, WHAT, FORMAT, VERSION, RECORD)
    payload = raw.get("payload")
    if not isinstance(payload, dict) or raw.get(HASH_FIELD) != digest(payload, leave_out=HASH_FIELD):
        raise GlanceError(f"reference {path} fails its checksum (damaged or edited); copy it again or {RECORD}")
    return guarded(path, RECORD, lambda: _parse(payload))


