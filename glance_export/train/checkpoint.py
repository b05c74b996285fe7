"""Trainer state kept beside the head it belongs to, so a killed `train-head` continues from its last
checkpoint instead of step 1.

The state (step, optimizer, schedule) lands in the head directory in the same atomic rename as the
weights, so weights and state always agree. Which samples and anchors a step trains on follows from the
seed and the step alone, so no generator is saved and the state resumes under any number of processes.
It is tied to the run's arguments by a signature: a different command into the same directory starts
afresh.

A head directory may come from anywhere, so its state is never unpickled: the optimizer's tensors are a
safetensors file and everything else is JSON in its metadata. A state written as a torch pickle before
that is still read, with `weights_only=True`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from glance_runtime.errors import GlanceError

STATE_FILE = "trainer_state.safetensors"
PICKLED_FILE = "trainer_state.pt"  # the earlier form
FORMAT = "glance-trainer-state"
VERSION = 1
FIX = "delete it to start afresh or restore it"


@dataclass(frozen=True)
class State:
    """Where an interrupted run stopped: its signature, the steps done, and the optimizer's and schedule's
    state dicts; `source` is the file it was read from."""
    signature: str
    step: int
    opt: dict[str, Any]
    sched: dict[str, Any]
    source: Path | None = field(default=None, compare=False)


def run_signature(model_dir: Path, data_files: Iterable[Path], **settings: Any) -> str:
    """Identity of a training run: the target's config, the data files' bytes and every setting."""
    digest = hashlib.sha256()
    digest.update((Path(model_dir) / "config.json").read_bytes())
    for path in data_files:
        digest.update(Path(path).read_bytes())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def capture(signature: str, step: int, opt: torch.optim.Optimizer, sched) -> State:
    return State(signature, step, opt.state_dict(), sched.state_dict())


def writer(state: State):
    """A `save_head(also=...)` callback writing `state` beside the weights."""
    return lambda directory: write(state, Path(directory) / STATE_FILE)


def write(state: State, path: Path) -> None:
    """Per-parameter optimizer tensors as `opt.<index>.<key>`; the rest as JSON in the file's metadata."""
    tensors, scalars = {}, {}
    for index, entries in state.opt["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    rest = {"signature": state.signature, "step": state.step, "param_groups": state.opt["param_groups"],
            "scalars": scalars, "sched": state.sched}
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": str(VERSION), "state": json.dumps(rest)})


def load_state(head_dir: Path, signature: str) -> State | None:
    """The state of an interrupted run with this signature in `head_dir`, else None; a state that cannot be
    read is refused in one line (starting afresh would overwrite the run it belongs to)."""
    head_dir = Path(head_dir)
    if (head_dir / STATE_FILE).is_file():
        state = _read(head_dir / STATE_FILE)
    elif (head_dir / PICKLED_FILE).is_file():
        state = _read_pickled(head_dir / PICKLED_FILE)
    else:
        return None
    return state if state.signature == signature else None


def _unreadable(path: Path, why: object) -> GlanceError:
    return GlanceError(f"cannot read trainer state {path} ({str(why).splitlines()[0] if str(why) else 'damaged'}); "
                       f"{FIX}")


def _read(path: Path) -> State:
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise ValueError(f"not a version {VERSION} {FORMAT} file")
        rest = json.loads(meta["state"])
        per_param: dict[int, dict[str, Any]] = {}
        for name, tensor in tensors.items():
            _, index, key = name.split(".", 2)
            per_param.setdefault(int(index), {})[key] = tensor
        for index, entries in rest["scalars"].items():
            per_param.setdefault(int(index), {}).update(entries)
        return _checked(path, rest["signature"], rest["step"], {"state": per_param,
                                                                "param_groups": rest["param_groups"]}, rest["sched"])
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise _unreadable(path, exc) from None


def _read_pickled(path: Path) -> State:
    try:
        raw = torch.load(path, weights_only=True, map_location="cpu")
        return _checked(path, raw["signature"], raw["step"], raw["opt"], raw["sched"])
    except Exception as exc:  # an unpickler meets any bytes: whatever it raises, the file is unreadable
        raise _unreadable(path, exc) from None


def _checked(path: Path, signature: Any, step: Any, opt: Any, sched: Any) -> State:
    """The fields' types, so a damaged state fails here and not inside the optimizer."""
    if not isinstance(signature, str) or type(step) is not int or step < 0 or not isinstance(sched, dict) \
            or not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) \
            or not isinstance(opt.get("param_groups"), list) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in opt["param_groups"]):
        raise ValueError("fields missing or of the wrong type")
    return State(signature, step, opt, sched, path)


def restore(state: State, opt: torch.optim.Optimizer, sched) -> int:
    """Put optimizer and schedule back; returns the step the state was saved after."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for index, entries in state.opt["state"].items():
        shapes = {tuple(v.shape) for v in entries.values() if isinstance(v, torch.Tensor) and v.dim()}
        if not (isinstance(index, int) and 0 <= index < len(params)) or shapes - {tuple(params[index].shape)}:
            raise GlanceError(f"trainer state {state.source} does not fit the head beside it (parameter {index}); "
                              f"{FIX}")
    try:
        opt.load_state_dict(state.opt)
        sched.load_state_dict(state.sched)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise _unreadable(state.source, exc) from None
    return state.step
