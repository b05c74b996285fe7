"""Prompts for training the default model's head: training-seed corpus samples as a task file.

The head learns from the target's own answers (the trainer generates them), so only the image and the
prompt of each sample are written; held-out seeds are never drawn here.
"""
from __future__ import annotations

import json
from pathlib import Path

from glance_runtime.store.atomic import output_directory

from .corpus import TASKS_FORMAT, training_sample


def write_training_tasks(out_dir: str | Path, n: int, seed: int = 1) -> Path:
    """`out_dir/tasks.jsonl` + images for `n` training samples of corpus run `seed`."""
    out_dir = output_directory(out_dir, TASKS_FORMAT, "glance-export corpus --kind train")
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        sample = training_sample(seed, i)
        rel = f"images/{sample.kind}_{i:05d}.png"
        sample.image.save(out_dir / rel)
        lines.append(json.dumps({"image": rel, "prompt": sample.prompt, "kind": sample.kind}))
    path = out_dir / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
