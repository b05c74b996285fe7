"""Record a task file's fp32 PyTorch greedy reference (workstation side; needs torch).

The recorded file lets a device without torch audit its engines against the same oracle the
workstation audit uses: `glance-export audit --reference FILE` reads it (`glance_runtime.formats.recorded_reference`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import transformers

from glance_runtime.decode.limits import check_prompt
from glance_runtime.errors import GlanceError
from glance_runtime.store.integrity import sha256

from glance_runtime._version import __version__
from ..model.adapters import Snapshot
from glance_runtime.formats.recorded_reference import RecordedTask, Reference
from glance_runtime.formats.tasks import read as read_tasks

from ..model.torch_backend import greedy_with_margins, snapshot_codec
from .reference_match import array_sha256, ids_sha256, image_sha256, model_source


def record_reference(model_dir: Path, tasks_path: Path, max_new_tokens: int,
                     progress: Callable[[str], None] = lambda _: None) -> Reference:
    """Greedy-decode every task with the fp32 model and keep tokens, margins and identities."""
    if max_new_tokens < 1:
        raise GlanceError("--max-new-tokens must be >= 1")
    tasks = read_tasks(tasks_path)
    if not tasks:
        raise GlanceError(f"{tasks_path} holds no prompts; a reference needs at least one")
    snapshot = Snapshot(model_dir)
    source = model_source(snapshot.path)
    codec = snapshot_codec(snapshot)
    prompts = [codec.turn(task.prompt, task.image) for task in tasks]
    if codec.max_positions is not None:  # refused by token count before the model loads
        for prompt in prompts:
            check_prompt(prompt.length, codec.max_positions, flag=False)
    model = snapshot.load_model("float32")
    stops = snapshot.stop_token_ids
    recorded = []
    for i, (task, prompt) in enumerate(zip(tasks, prompts), 1):
        tokens, margins = greedy_with_margins(model, snapshot, prompt, max_new_tokens, stops)
        recorded.append(RecordedTask(prompt=task.prompt, image_sha256=image_sha256(task),
                                     input_ids_sha256=ids_sha256(prompt.input_ids),
                                     pixels_sha256=array_sha256(prompt.pixel_values),
                                     tokens=tokens, margins=margins))
        progress(f"[{i}/{len(tasks)}] {len(tokens)} tokens, smallest top-2 margin {min(margins):.4g}")
    return Reference(source=source, tasks_sha256=sha256(Path(tasks_path)), max_new_tokens=max_new_tokens,
                     stop_token_ids=tuple(stops), toolkit_version=__version__,
                     recorded_with={"torch": torch.__version__, "transformers": transformers.__version__,
                                    "dtype": "float32"},
                     tasks=tuple(recorded))
