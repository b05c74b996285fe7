"""Training data prepared once (offline): the target's answers and the tapped hidden states of prompt + answer,
in bf16 shards with an index, so training reads them instead of running the target.

`prepare` answers every sample (stage 1 of online training), counts the bytes the taps will take and refuses
when the disk lacks them, then taps one sequence at a time and writes a shard whenever the shard size is
reached: its memory is one shard and one forward whatever the data set's size. Training opens the shards by
memory map and reads only the rows of the sequences a step uses; of the target it loads only the input
embedding and the LM head.

Layout: `index.json` {format, version, target (config digest), target_layer_ids, width, samples, shards:
[{file, sequences: [[offset, length, answer_start], ...], rows, size, sha256}]} and `shard_NNNNN.safetensors`
holding `taps` bf16 [rows, width] and `ids` int64 [rows], sequences back to back (prepared_index.py checks
both before training reads a row).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glance_runtime.errors import GlanceError
from glance_runtime.store.atomic import atomic_directory, check_output

from ..model.adapters import Snapshot
from ..model.eagle3 import default_aux_layers
from ..model.head import tap_layers
from .answers import tap_rows
from .data_files import Tally, check_files, read_samples
from .head_loss import Sequence
from .prepared_index import FORMAT, INDEX, TAP_DTYPE, VERSION, check_shards, read_index, shard_entry
from .sequences import answer_samples, prompt_of
from .world import World

MADE_BY = "glance-export prepare-head-data"
ROOM_MARGIN = 1.05  # index, safetensors headers and the filesystem's rounding


def target_digest(snapshot: Snapshot) -> str:
    return hashlib.sha256((snapshot.path / "config.json").read_bytes()).hexdigest()


def sequence_bytes(rows: int, width: int) -> int:
    return rows * (width * TAP_DTYPE.itemsize + 8)


def check_room(out: Path, need: int) -> None:
    """Refuse before writing when the output's filesystem lacks `need` bytes (with a margin)."""
    probe = out.parent if not out.exists() else out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need * ROOM_MARGIN > free:
        raise GlanceError(f"the prepared data needs about {need * ROOM_MARGIN / 2**30:.2f} GiB but {probe} has "
                          f"{free / 2**30:.2f} GiB free; free space, pick another --out, or lower --max-new-tokens")


def prepare(model_dir: Path, data: list[Path], out: Path, *, layers: int, max_new_tokens: int, gen_batch: int,
            shard_mb: float, world: World, progress: Callable[[str], None] = print, arch: str = "glance") -> Path:
    """Answer and tap every sample of `data` into `out` (see the module's docstring); the taps are the layers a
    GLANCE head of `layers` layers reads, or with `arch` "eagle3" an EAGLE-3 head's three default aux layers."""
    check_files(data, "training data")
    check_output(out, FORMAT, (model_dir, *data))
    snapshot = Snapshot(model_dir)
    depth = snapshot.text_config["num_hidden_layers"]
    layer_ids = default_aux_layers(depth) if arch == "eagle3" else tap_layers(depth, layers)
    model = snapshot.load_model("bfloat16" if world.device.type == "cuda" else "float32").to(world.device)
    tally = Tally()
    samples = read_samples(data, tally)
    progress(f"stage 1/2: target answers to {len(samples)} samples")
    seqs, answered = answer_samples(snapshot, model, samples, max_new_tokens, gen_batch, world, tally, progress)
    progress(tally.summary())
    tally.check()
    if not seqs:
        raise GlanceError("no training sample could be used; check the data files")
    width = len(layer_ids) * snapshot.text_config["hidden_size"]
    need = sum(sequence_bytes(q.length, width) for q in seqs)
    progress(f"stage 2/2: taps of layers {layer_ids} for {len(seqs)} sequences, about {need / 2**30:.3f} GiB")
    check_room(out, need)
    limit = max(1, int(shard_mb * 2**20))
    index = {"format": FORMAT, "version": VERSION, "target": target_digest(snapshot), "target_layer_ids": layer_ids,
             "width": width, "samples": len(samples), "shards": []}
    with atomic_directory(out, FORMAT, MADE_BY) as tmp:
        taps: list[torch.Tensor] = []
        ids: list[torch.Tensor] = []
        entries: list[list[int]] = []
        rows = 0

        def flush() -> None:
            nonlocal taps, ids, entries, rows
            name = f"shard_{len(index['shards']):05d}.safetensors"
            save_file({"taps": torch.cat(taps), "ids": torch.cat(ids)}, str(tmp / name))
            index["shards"].append(shard_entry(tmp, name, entries, rows))
            progress(f"wrote {name} ({len(entries)} sequences, {rows} rows)")
            taps, ids, entries, rows = [], [], [], 0

        for q in seqs:
            prompt = prompt_of(snapshot, samples[q.sample])
            answer = answered.pop(q.sample)
            t = tap_rows(snapshot, model, prompt, answer[prompt.length:].tolist(), layer_ids).to("cpu", TAP_DTYPE)
            entries.append([rows, q.length, q.answer_start])
            taps.append(t)
            ids.append(answer)
            rows += q.length
            if sequence_bytes(rows, width) >= limit:
                flush()
        if entries:
            flush()
        (tmp / INDEX).write_text(json.dumps(index))
    progress(f"wrote {sum(len(s['sequences']) for s in index['shards'])} sequences in {len(index['shards'])} "
             f"shards to {out}")
    return out


@dataclass
class PreparedData:
    """The sequences of a prepared directory, and their ids and taps read from disk when a step needs them."""
    root: Path
    index: dict
    sequences: list[Sequence]
    shard_of: list[tuple[int, int]]  # per sequence: (shard number, first row)

    @classmethod
    def open(cls, root: Path, snapshot: Snapshot, progress: Callable[[str], None] = lambda _: None) -> "PreparedData":
        """The checked directory (prepared_index.py): every refusal comes here, before the first step."""
        index = read_index(root)
        if index["target"] != target_digest(snapshot):
            raise GlanceError(f"{root} was prepared for another target than {snapshot.path}; pass the --model it was "
                              "prepared with, or prepare the data again")
        tc = snapshot.text_config
        if index["width"] != len(index["target_layer_ids"]) * tc["hidden_size"]:
            raise GlanceError(f"{Path(root) / INDEX} records taps {index['width']} wide, not "
                              f"{len(index['target_layer_ids'])} layers of {tc['hidden_size']}; prepare the data again")
        check_shards(Path(root), index, tc["vocab_size"], progress)
        seqs, where = [], []
        for n, shard in enumerate(index["shards"]):
            for offset, length, start in shard["sequences"]:
                seqs.append(Sequence(length, start, len(seqs)))
                where.append((n, offset))
        return cls(Path(root), index, seqs, where)

    def ids_of(self, seq: Sequence) -> torch.Tensor:
        shard, offset = self.shard_of[seq.sample]
        with safe_open(str(self.root / self.index["shards"][shard]["file"]), "pt") as f:
            return f.get_slice("ids")[offset:offset + seq.length]

    def __call__(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, taps) of one sequence, read from its shard's memory map."""
        shard, offset = self.shard_of[seq.sample]
        rows = slice(offset, offset + seq.length)
        with safe_open(str(self.root / self.index["shards"][shard]["file"]), "pt") as f:
            return f.get_slice("ids")[rows], f.get_slice("taps")[rows]


def token_layers(snapshot: Snapshot, device: torch.device) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """The target's input embedding and LM head only (the LM head is the embedding where the target ties
    them), read from its safetensors without building the model."""
    files = sorted(snapshot.path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if (key.endswith("embed_tokens.weight") and "visual" not in key) or key == "lm_head.weight":
                    tensors["lm_head" if key == "lm_head.weight" else "embed"] = f.get_tensor(key)
    if "embed" not in tensors:
        raise GlanceError(f"{snapshot.path} has no embed_tokens weight in its safetensors; restore its weights")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.nn.Embedding.from_pretrained(tensors["embed"].to(dtype), freeze=True).to(device)
    weight = tensors.get("lm_head", tensors["embed"]).to(dtype)
    lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device, dtype=dtype)
    lm_head.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
    return embed, lm_head
