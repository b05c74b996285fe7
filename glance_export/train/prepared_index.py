"""The index of a prepared directory (prepared.py) and its checks, run once when training opens it.

Training reads a sequence's rows only when a step needs them, so a damaged or edited directory found there
would stop a run hours in with a traceback, or train on the wrong rows without a word. `read_index` and
`check_shards` refuse it up front instead: the index's structure, each shard's place (a plain file inside the
directory), size, sha256 and tensors, and each sequence's rows inside its shard. A shard's digest is reused while
its file's stat is unchanged (store/integrity's stamps), so only the first run over new data hashes it.
Directories written before shards recorded their size, hash and rows are checked for everything else.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from glance_runtime.errors import GlanceError
from glance_runtime.store.integrity import Stamps, record

FORMAT = "glance-head-data"
VERSION = 1
INDEX = "index.json"
TAP_DTYPE = torch.bfloat16
REPREPARE = "prepare the data again with `glance-export prepare-head-data`"
LOUD_BYTES = 1 << 30  # shards this large take a while to hash: say so first


def shard_entry(directory: Path, name: str, sequences: list[list[int]], rows: int) -> dict[str, Any]:
    """What the index records of a written shard: its sequences, rows, size and sha256."""
    return {"file": name, "sequences": sequences, "rows": rows, **record(directory, [name])[name]}


def read_index(root: Path) -> dict[str, Any]:
    """The parsed index.json of `root`, its fields of the right types (the shards are checked by `check_shards`)."""
    root = Path(root)
    if not root.is_dir():
        state = "is not a directory" if root.exists() else "does not exist"
        raise GlanceError(f"--prepared {root} {state}; pass the directory `glance-export prepare-head-data` wrote")
    path = root / INDEX
    if not path.is_file():
        raise GlanceError(f"{root} holds no {INDEX}; pass a directory `glance-export prepare-head-data` wrote")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise GlanceError(f"cannot read {path} ({exc}); {REPREPARE}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise GlanceError(f"{path} is not a version {VERSION} {FORMAT} index; {REPREPARE}")
    for key, kind in (("target", str), ("target_layer_ids", list), ("width", int), ("shards", list)):
        if not isinstance(index.get(key), kind) or isinstance(index.get(key), bool):
            raise GlanceError(f"{path} lacks {key!r} (or it is not a {kind.__name__}); {REPREPARE}")
    if not all(type(i) is int for i in index["target_layer_ids"]) or index["width"] < 1:
        raise GlanceError(f"{path} records bad target_layer_ids or width; {REPREPARE}")
    if not index["shards"]:
        raise GlanceError(f"{path} lists no shards; {REPREPARE}")
    for n, shard in enumerate(index["shards"]):
        if not isinstance(shard, dict) or not isinstance(shard.get("sequences"), list) or not shard["sequences"]:
            raise GlanceError(f"{path}: shard {n} is not {{file, sequences: [[offset, length, answer_start], ...]}}; "
                              f"{REPREPARE}")
        name = shard.get("file")
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name \
                or (root / name).resolve().parent != root.resolve():
            raise GlanceError(f"{path}: shard {n}'s file {name!r} is not a file inside {root}; {REPREPARE}")
        for j, seq in enumerate(shard["sequences"]):
            if not isinstance(seq, list) or len(seq) != 3 or not all(type(v) is int for v in seq):
                raise GlanceError(f"{path}: sequence {j} of shard {n} is {json.dumps(seq)[:40]}, not [offset, "
                                  f"length, answer_start]; {REPREPARE}")
    return index


def check_shards(root: Path, index: dict[str, Any], vocab_size: int,
                 progress: Callable[[str], None] = lambda _: None) -> None:
    """Every shard against its record (size and sha256, where recorded), its tensors against the index's width,
    and every sequence's rows inside its shard, before the first step reads any."""
    root = Path(root)
    shards = index["shards"]
    for shard in shards:
        if not (root / shard["file"]).is_file():
            raise GlanceError(f"{root / shard['file']} is missing; restore it or {REPREPARE}")
    _check_hashes(root, [s for s in shards if isinstance(s.get("sha256"), str) and type(s.get("size")) is int],
                  progress)
    for n, shard in enumerate(shards):
        path = root / shard["file"]
        rows = _shard_rows(path, index["width"], vocab_size)
        if "rows" in shard and shard["rows"] != rows:
            raise GlanceError(f"{path} holds {rows} rows but {INDEX} records {shard['rows']!r} (another shard in its "
                              f"place); restore it or {REPREPARE}")
        for j, (offset, length, start) in enumerate(shard["sequences"]):
            if offset < 0 or length < 1 or not 0 <= start <= length or offset + length > rows:
                raise GlanceError(f"{root / INDEX}: sequence {j} of shard {n} ([{offset}, {length}, {start}]) lies "
                                  f"outside the shard's {rows} rows; {REPREPARE}")


def _check_hashes(root: Path, shards: list[dict[str, Any]], progress: Callable[[str], None]) -> None:
    """Each shard's size and sha256 against its record (a digest is reused while the file's stat is unchanged)."""
    total = sum(s["size"] for s in shards)
    if total >= LOUD_BYTES:
        progress(f"checking the sha256 of {len(shards)} shards ({total / 2**30:.1f} GiB) in {root}")
    stamps = Stamps(root)
    try:
        for shard in shards:
            path = root / shard["file"]
            if path.stat().st_size != shard["size"]:
                raise GlanceError(f"{path} is {path.stat().st_size} bytes but {INDEX} records {shard['size']} "
                                  f"(truncated or another shard in its place); restore it or {REPREPARE}")
            if stamps.digest(shard["file"]) != shard["sha256"]:
                raise GlanceError(f"{path} does not match the sha256 {INDEX} records (damaged or another shard in "
                                  f"its place); restore it or {REPREPARE}")
    finally:
        stamps.save()


def _shard_rows(path: Path, width: int, vocab_size: int) -> int:
    """Rows of a shard whose `taps` [rows, width] bf16 and `ids` [rows] int64 hold target token ids."""
    try:
        with safe_open(str(path), "pt") as f:
            if set(f.keys()) != {"taps", "ids"}:
                raise GlanceError(f"{path} holds {sorted(f.keys())}, not taps and ids; {REPREPARE}")
            taps, ids = f.get_slice("taps"), f.get_slice("ids")
            rows = ids.get_shape()[0] if len(ids.get_shape()) == 1 else -1
            if taps.get_dtype() != "BF16" or ids.get_dtype() != "I64" or taps.get_shape() != [rows, width]:
                raise GlanceError(f"{path} holds taps {taps.get_dtype()} {taps.get_shape()} and ids {ids.get_dtype()} "
                                  f"{ids.get_shape()}, not BF16 [rows, {width}] and I64 [rows]; {REPREPARE}")
            values = f.get_tensor("ids")
    except (SafetensorError, OSError) as exc:
        raise GlanceError(f"cannot read {path} ({exc}); restore it or {REPREPARE}") from None
    if rows and not 0 <= int(values.min()) <= int(values.max()) < vocab_size:
        raise GlanceError(f"{path} holds token ids outside the target's vocabulary of {vocab_size}; restore it or "
                          f"{REPREPARE}")
    return rows
