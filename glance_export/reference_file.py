"""A recorded fp32 greedy reference: written on a workstation with torch, read on a device without it.

A Jetson has no PyTorch, so the oracle's tokens travel as a file, with the fp32 top-2 logit margin at
every step (what shows a reduced-precision divergence to be a near-tie, or not). The file names what it
was recorded for (the model's hashes as an artifacts manifest records them, the tasks, the settings) so
a mismatched use is refused in one line, and a checksum over its payload catches a damaged copy.
Torch-free: the device side imports this module.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from glance_runtime.atomic import write_file
from glance_runtime.errors import GlanceError
from glance_runtime.manifest import sha256
from glance_runtime.tasks import Task

FORMAT = "glance-reference"
FORMAT_VERSION = 1
RECORD = "record it again with `glance-export audit --save-reference FILE --data TASKS.jsonl`"


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


def model_source(model_dir: Path) -> dict[str, Any]:
    """The model's identity exactly as `glance-export onnx` writes it into manifest.json's `source`."""
    return {"config_sha256": sha256(model_dir / "config.json"),
            "weights_sha256": {p.name: sha256(p) for p in sorted(model_dir.glob("*.safetensors"))}}


def array_sha256(values: np.ndarray | None) -> str | None:
    if values is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def ids_sha256(ids: np.ndarray) -> str:
    return array_sha256(np.asarray(ids, dtype=np.int64))


def image_sha256(task: Task) -> str | None:
    if task.image is None:
        return None
    if not Path(task.image).is_file():
        raise GlanceError(f"image {task.image} of prompt {task.prompt!r} does not exist; fix the task file")
    return sha256(Path(task.image))


def _payload(ref: Reference) -> dict[str, Any]:
    body = asdict(ref)
    body["stop_token_ids"] = list(ref.stop_token_ids)
    body["tasks"] = [asdict(t) for t in ref.tasks]
    return body


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_destination(path: Path) -> None:
    """Refuse, before minutes of decoding, a reference path that cannot be written."""
    if path.is_dir():
        raise GlanceError(f"--save-reference {path} is a directory; give a file name such as {path}/reference.json")


def write_reference(path: str | Path, ref: Reference) -> Path:
    """Written to a temporary sibling and renamed, so FILE is the old reference or the new one, never half."""
    path = Path(path)
    check_destination(path)
    payload = _payload(ref)
    text = json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "payload_sha256": _digest(payload),
                       "payload": payload}, indent=1)
    try:
        write_file(path, text)
    except OSError as exc:
        raise GlanceError(f"cannot write {path} ({exc.strerror}); pick a writable --save-reference path") from None
    return path


def load_reference(path: str | Path) -> Reference:
    """Parse and verify FILE; anything unreadable, foreign or altered is one GlanceError."""
    path = Path(path)
    if not path.is_file():
        raise GlanceError(f"reference {path} does not exist; {RECORD}")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not text"
        raise GlanceError(f"reference {path} is damaged or truncated ({reason}); copy it again or {RECORD}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise GlanceError(f"{path} is not a GLANCE reference file; {RECORD}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise GlanceError(f"reference {path} is format v{raw.get('format_version')}, this toolkit reads "
                          f"v{FORMAT_VERSION}; {RECORD}")
    payload = raw.get("payload")
    if not isinstance(payload, dict) or raw.get("payload_sha256") != _digest(payload):
        raise GlanceError(f"reference {path} fails its checksum (damaged or edited); copy it again or {RECORD}")
    try:
        tasks = tuple(RecordedTask(**t) for t in payload["tasks"])
        return Reference(source=payload["source"], tasks_sha256=payload["tasks_sha256"],
                         max_new_tokens=int(payload["max_new_tokens"]),
                         stop_token_ids=tuple(int(i) for i in payload["stop_token_ids"]),
                         toolkit_version=payload["toolkit_version"], recorded_with=payload["recorded_with"],
                         tasks=tasks)
    except (KeyError, TypeError, ValueError) as exc:
        raise GlanceError(f"reference {path} is incomplete ({type(exc).__name__}: {exc}); {RECORD}") from None


def check_reference(ref: Reference, path: Path, *, source: dict[str, Any], where: str, tasks: Sequence[Task],
                    tasks_path: Path, stop_ids: Sequence[int], max_new_tokens: int) -> None:
    """Refuse a reference recorded for another model, other tasks or other settings than this audit's."""
    if source.get("config_sha256") != ref.source.get("config_sha256") or \
            (source.get("weights_sha256") or {}) != (ref.source.get("weights_sha256") or {}):
        raise GlanceError(f"reference {path} was recorded for another model than {where} (config or weights "
                          "hashes differ); audit artifacts exported from the recorded model, or record the reference "
                          "from the model these were exported from")
    if len(tasks) != len(ref.tasks):
        raise GlanceError(f"reference {path} holds {len(ref.tasks)} prompts but {tasks_path} has {len(tasks)}; "
                          "pass the task file it was recorded from")
    for i, (task, rec) in enumerate(zip(tasks, ref.tasks), 1):
        if task.prompt != rec.prompt or image_sha256(task) != rec.image_sha256:
            what = "prompt" if task.prompt != rec.prompt else "image"
            raise GlanceError(f"task {i} of {tasks_path} has another {what} than reference {path} was recorded "
                              "for; pass the task file (and images) it was recorded from")
    if tuple(sorted(int(s) for s in stop_ids)) != tuple(sorted(ref.stop_token_ids)):
        raise GlanceError(f"reference {path} stops on token ids {list(ref.stop_token_ids)} but {where} stops on "
                          f"{sorted(stop_ids)}; record the reference from the same model")
    if max_new_tokens != ref.max_new_tokens:
        raise GlanceError(f"reference {path} was recorded with --max-new-tokens {ref.max_new_tokens}; "
                          f"audit with the same value (or leave it out)")
