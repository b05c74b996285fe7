"""A reduced draft vocabulary's target ids: the rule they must meet, and their reading from an exported
draft_vocab graph.

A head drafting over N tokens maps each of its N logits to a target id. Ids that repeat or fall outside the
target's vocabulary do not fail where they are used: a repeated id gives a draft row the same token twice (the
tree refuses it mid-answer), an id past the vocabulary reads past the LM head. The export side checks a head's
`draft_vocab_ids` with `ids_problem` when it loads the head; the runtime reads the ids baked into
draft_vocab.onnx (the int64 initializer its `topk_ids` output is gathered from) and checks them with the same rule at
load, so a graph exported from such a head is refused before the first answer. The ONNX file is walked as
protobuf without the onnx package (the edge install has none), mapped rather than read, its tensors skipped.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from ..errors import IntegrityError
from .protobuf import fields, ints

INT64 = 7  # onnx.TensorProto.INT64
EXTERNAL = 1  # onnx.TensorProto.EXTERNAL
OUTPUT = "topk_ids"


def ids_problem(ids: np.ndarray, size: int, vocab_size: int) -> str | None:
    """What is wrong with a draft vocabulary's ids, or None: `size` distinct integers in 0..vocab_size-1."""
    if ids.ndim != 1 or len(ids) != size:
        return f"holds {list(ids.shape)} values, not the {size} of draft_vocab_size"
    if not np.issubdtype(ids.dtype, np.integer):
        return f"holds {ids.dtype} values, not integer token ids"
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if len(outside):
        return f"holds id {int(outside[0])}, outside the target's vocabulary 0..{vocab_size - 1}"
    values, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        return f"holds id {int(values[counts > 1][0])} more than once"
    return None


def check_graph(path: Path, size: int, vocab_size: int, fix: str) -> None:
    """Refuse a draft_vocab graph whose ids break `ids_problem` (or cannot be found in it)."""
    try:
        ids = graph_ids(Path(path))
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"cannot read the draft vocabulary's ids from {path} ({exc}); {fix}") from None
    problem = ids_problem(ids, size, vocab_size)
    if problem is not None:
        raise IntegrityError(f"{path} maps its draft tokens to target ids that are not distinct ids of the target: "
                             f"its draft vocabulary {problem} (its head's draft_vocab_ids were bad); fix or retrain "
                             f"the head, then {fix}")


def graph_ids(path: Path) -> np.ndarray:
    """The int64 tensor the draft_vocab graph gathers `topk_ids` from (ValueError where there is none)."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            name, tensor = _find(view)
        finally:
            view.release()
    if tensor is None:
        raise ValueError(f"no int64 initializer feeds its {OUTPUT} output")
    dims, data_type, raw, values, external = tensor
    if data_type != INT64 or len(dims) != 1:
        raise ValueError(f"{name} is not a one-dimensional int64 tensor")
    if external is not None:
        raw = _external(path.parent, external)
    ids = np.frombuffer(raw, dtype="<i8").copy() if raw is not None else np.asarray(values, dtype=np.int64)
    if len(ids) != dims[0]:
        raise ValueError(f"{name} holds {len(ids)} values but its shape says {dims[0]}")
    return ids


def _find(model: memoryview) -> tuple[str | None, tuple | None]:
    """(name, parsed tensor) of the initializer `topk_ids` is gathered from: the first inputs of the nodes
    before it, followed back to an initializer (a Gather under the TorchScript exporter, Transpose, GatherND and
    Transpose under dynamo's); copies only."""
    graph = next((v for n, w, v in fields(model) if n == 7 and w == 2), None)
    if graph is None:
        raise ValueError("no graph")
    first_input: dict[str, str] = {}
    for number, wire, value in fields(graph):
        if number == 1 and wire == 2:
            inputs = [bytes(v).decode() for n, w, v in fields(value) if n == 1 and w == 2]
            for output in (bytes(v).decode() for n, w, v in fields(value) if n == 2 and w == 2):
                if inputs:
                    first_input[output] = inputs[0]
    tensors = {}
    for number, wire, value in fields(graph):
        if number == 5 and wire == 2:
            tensor = _tensor(value)
            tensors[tensor[0]] = tensor[1:]
    name = OUTPUT
    for _ in range(len(first_input) + 1):
        if name in tensors or name not in first_input:
            break
        name = first_input[name]
    return name, tensors.get(name)


def _tensor(message: memoryview) -> tuple:
    """(name, dims, data_type, raw_data copy or None, int64_data, external_data dict or None) of a TensorProto;
    raw_data is copied only for int64 tensors, so weight rows are never read."""
    name, dims, data_type, raw, values, external, location = None, [], 0, None, [], {}, 0
    for number, wire, value in fields(message):
        if number == 1:
            dims += ints(wire, value)
        elif number == 2 and wire == 0:
            data_type = value
        elif number == 7:
            values += ints(wire, value)
        elif number == 8 and wire == 2:
            name = bytes(value).decode()
        elif number == 9 and wire == 2:
            raw = value
        elif number == 13 and wire == 2:
            entry = {n: bytes(v).decode() for n, w, v in fields(value) if w == 2}
            external[entry.get(1, "")] = entry.get(2, "")
        elif number == 14 and wire == 0:
            location = value
    raw = bytes(raw) if raw is not None and data_type == INT64 else None
    return name, dims, data_type, raw, values, external if location == EXTERNAL else None


def _external(directory: Path, info: dict[str, str]) -> bytes:
    """An external tensor's bytes, from a file beside the graph (never outside its directory)."""
    location = info.get("location", "")
    target = (directory / location).resolve()
    if not location or target.parent != directory.resolve():
        raise ValueError(f"external data {location!r} is not a file beside the graph")
    offset, length = int(info.get("offset") or 0), info.get("length")
    with open(target, "rb") as fh:
        fh.seek(offset)
        data = fh.read(-1 if length is None else int(length))
    if length is not None and len(data) != int(length):
        raise ValueError(f"external data {location} is shorter than recorded")
    return data
