"""Using a recorded fp32 greedy reference: the identities it is recorded against, and the refusal of one
recorded for another model, other tasks or other settings. The file itself (schema, version, checksum)
is `glance_runtime.formats.recorded_reference`. Torch-free: the device side imports this module.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from glance_runtime.errors import GlanceError
from glance_runtime.formats import recorded_reference as reference_format
from glance_runtime.formats.recorded_reference import Reference
from glance_runtime.formats.tasks import Task
from glance_runtime.store.atomic import check_output_file
from glance_runtime.store.integrity import sha256


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


def check_destination(path: Path, inputs: Sequence[Path | None] = ()) -> None:
    """Refuse, before minutes of decoding, a reference path that cannot be written or holds a file that is
    not a reference (a model's config.json, the task file itself): only a reference is ever replaced."""
    if path.is_dir():
        raise GlanceError(f"--save-reference {path} is a directory; give a file name such as {path}/reference.json")
    check_output_file(path, reference_format.FORMAT, inputs)


def write_reference(path: str | Path, ref: Reference, inputs: Sequence[Path | None] = ()) -> Path:
    """Checked as `check_destination` again, then written whole (`formats.recorded_reference.write`)."""
    check_destination(Path(path), inputs)
    return reference_format.write(path, ref)


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
