"""The ids and tapped hidden states of a training sequence, the taps computed by the target when a step needs
them (online).

Taps of sequences seen before are kept while they fit in a fixed memory allowance, so a small data set is
tapped once and a large one costs one target pass per sequence per step, never memory that grows with it.
"""
from __future__ import annotations

import torch

from ..model.adapters import Snapshot
from .answers import tap_rows
from .data_files import Sample
from .head_loss import Sequence
from .sequences import prompt_of

KEEP_BYTES = 2 << 30


class OnlineTaps:
    def __init__(self, snapshot: Snapshot, model, samples: list[Sample], ids: dict[int, torch.Tensor],
                 layer_ids: list[int], keep_bytes: int = KEEP_BYTES):
        self.snapshot, self.model, self.samples, self.ids, self.layer_ids = snapshot, model, samples, ids, layer_ids
        self.kept: dict[int, torch.Tensor] = {}
        self.room = keep_bytes

    def ids_of(self, seq: Sequence) -> torch.Tensor:
        return self.ids[seq.sample]

    def __call__(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.ids[seq.sample]
        taps = self.kept.get(seq.sample)
        if taps is None:
            prompt = prompt_of(self.snapshot, self.samples[seq.sample])
            taps = tap_rows(self.snapshot, self.model, prompt, ids[prompt.length:].tolist(), self.layer_ids)
            size = taps.numel() * taps.element_size()
            if size <= self.room:
                self.kept[seq.sample] = taps
                self.room -= size
        return ids, taps
