"""Trainer state kept beside the head it belongs to, so a killed `train-head` continues from its last
checkpoint instead of step 1.

The state (step, optimizer, schedule) lands in the head directory in the same atomic rename as the
weights, so weights and state always agree. Which samples and anchors a step trains on follows from the
seed and the step alone, so no generator is saved and the state resumes under any number of processes.
It is tied to the run's arguments by a signature: a different command into the same directory starts
afresh.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import torch

STATE_FILE = "trainer_state.pt"


def run_signature(model_dir: Path, data_files: Iterable[Path], **settings: Any) -> str:
    """Identity of a training run: the target's config, the data files' bytes and every setting."""
    digest = hashlib.sha256()
    digest.update((Path(model_dir) / "config.json").read_bytes())
    for path in data_files:
        digest.update(Path(path).read_bytes())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def capture(signature: str, step: int, opt: torch.optim.Optimizer, sched) -> dict[str, Any]:
    return {"signature": signature, "step": step, "opt": opt.state_dict(), "sched": sched.state_dict()}


def writer(state: dict[str, Any]):
    """A `save_head(also=...)` callback writing `state` beside the weights."""
    return lambda directory: torch.save(state, directory / STATE_FILE)


def load_state(head_dir: Path, signature: str) -> dict[str, Any] | None:
    """The state of an interrupted run with this signature in `head_dir`, else None."""
    path = Path(head_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except (OSError, RuntimeError, EOFError):
        return None
    return state if state.get("signature") == signature else None


def restore(state: dict[str, Any], opt: torch.optim.Optimizer, sched) -> int:
    """Put optimizer and schedule back; returns the step the state was saved after."""
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return int(state["step"])
