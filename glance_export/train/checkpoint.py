"""Trainer state kept beside the head it belongs to, so a killed `train-head` continues from its last
checkpoint instead of step 1.

The state (step, optimizer, schedule, both random generators) lands in the head directory in the
same atomic rename as the weights, so weights and state always agree. It is tied to the run's
arguments by a signature: a different command into the same directory starts afresh.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.pt"


def run_signature(model_dir: Path, task_file: Path, **settings: Any) -> str:
    """Identity of a training run: the target's config, the task file's bytes and every setting."""
    digest = hashlib.sha256()
    digest.update((Path(model_dir) / "config.json").read_bytes())
    digest.update(Path(task_file).read_bytes())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def capture(signature: str, step: int, opt: torch.optim.Optimizer, sched, rng: random.Random) -> dict[str, Any]:
    return {"signature": signature, "step": step, "opt": opt.state_dict(), "sched": sched.state_dict(),
            "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}


def writer(state: dict[str, Any]):
    """A `save_head(also=...)` callback writing `state` beside the weights."""
    return lambda directory: torch.save(state, directory / STATE_FILE)


def load_state(head_dir: Path, signature: str) -> dict[str, Any] | None:
    """The state of an interrupted run with this signature in `head_dir`, else None."""
    path = Path(head_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError):
        return None
    return state if state.get("signature") == signature else None


def restore(state: dict[str, Any], opt: torch.optim.Optimizer, sched, rng: random.Random) -> int:
    """Put optimizer, schedule and generators back; returns the step the state was saved after."""
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    rng.setstate(_tuples(state["rng"]))
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def _tuples(value):
    """random.setstate needs tuples where a round trip may hand back lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
