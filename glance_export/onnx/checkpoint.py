"""A snapshot's safetensors as an index of tensors (file, dtype, shape, byte range), read one tensor at a time.

Sharded snapshots name their files in `model.safetensors.index.json`; single-file ones are found by glob.
Reads are positioned file reads, not safetensors' memory map: every page of a mapped shard that is touched
stays in the process's resident set until the shard is unmapped, so streaming a whole snapshot through
one map would count all of it in peak RSS. A read costs one tensor's bytes, freed when the caller drops it.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from glance_runtime.errors import GlanceError

INDEX = "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    length: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _header(path: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file (8-byte little-endian header length, JSON header, data)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GlanceError(f"{path} is not a readable safetensors file ({exc}); restore it from the model's "
                          "source") from None
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise GlanceError(f"{path}: tensor {key} has dtype {info['dtype']}, which the exporter does not read; "
                              "convert the checkpoint to F32, F16 or BF16")
        begin, end = info["data_offsets"]
        entries[key] = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + begin, end - begin)
    return entries


class Checkpoint:
    """Every tensor of a snapshot directory by its checkpoint key."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        index = root / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise GlanceError(f"{index} is not a safetensors index ({exc}); restore it from the model's "
                                  "source") from None
            files = sorted({root / name for name in weight_map.values()})
            missing = [p.name for p in files if not p.is_file()]
            if missing:
                raise GlanceError(f"{root} lacks {', '.join(missing)} named in {INDEX}; download the missing shards")
        else:
            files = sorted(root.glob("*.safetensors"))
        self.entries: dict[str, Entry] = {}
        for path in files:
            self.entries.update(_header(path))

    def read(self, key: str, dtype: torch.dtype | None = None, buffer: bytearray | None = None) -> torch.Tensor:
        """One tensor, cast to dtype (e.g. bf16 -> fp16) as it is read. `buffer`: read into its first bytes
        (one buffer for weight after weight maps no fresh pages; the tensor is valid until it is reused)."""
        entry = self.entries[key]
        buf = memoryview(buffer)[:entry.length] if buffer is not None and len(buffer) >= entry.length \
            else bytearray(entry.length)
        with open(entry.file, "rb") as f:
            f.seek(entry.start)
            if f.readinto(buf) != entry.length:
                raise GlanceError(f"{entry.file} ends inside tensor {key}; restore the file from the model's source")
        tensor = torch.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape) if entry.length else \
            torch.empty(entry.shape, dtype=entry.dtype)
        return tensor if dtype is None or dtype == entry.dtype else tensor.to(dtype)

    def rows(self, key: str, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` of a tensor (a draft vocabulary's of the embedding), each read on its own: a fraction
        of the matrix, which is not read whole."""
        entry = self.entries[key]
        width = entry.length // entry.shape[0] if entry.shape and entry.shape[0] else 0
        buf = bytearray(width * len(ids))
        with open(entry.file, "rb", buffering=0) as f:
            for i, row in enumerate(ids.tolist()):
                if not 0 <= row < entry.shape[0]:
                    raise GlanceError(f"row {row} is outside {key}'s {entry.shape[0]} rows; use a head made for this "
                                      "target")
                if os.preadv(f.fileno(), [memoryview(buf)[i * width:(i + 1) * width]], entry.start + row * width) \
                        != width:
                    raise GlanceError(f"{entry.file} ends inside tensor {key}; restore the file from the model's "
                                      "source")
        tensor = torch.frombuffer(buf, dtype=entry.dtype).reshape(len(ids), *entry.shape[1:]) if buf else \
            torch.empty((len(ids), *entry.shape[1:]), dtype=entry.dtype)
        return tensor if dtype is None or dtype == entry.dtype else tensor.to(dtype)

    def nbytes(self, itemsize: int | None = None) -> int:
        """Bytes of all tensors, as stored or at `itemsize` bytes per floating-point element."""
        return sum(e.numel * itemsize if itemsize and e.dtype.is_floating_point else e.length
                   for e in self.entries.values())
