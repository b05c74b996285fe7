"""A sampled or reported pass's tokens from the rows of the vocab graph's logits, wherever the logits are.

The one place a graph backend (alone or batched) turns a `Draw` and a projection's logits into each row's token,
its log-prob and its report. On the CPU the rows are read as numpy arrays and `decode/sampling.py` runs on them. On
a GPU the logits stay on the device: `DeviceSampler` runs the same rule as one kernel and brings back a few bytes a
row. Where that kernel cannot be built (no NVRTC), decoding goes on with the host's copy and says so once. A
greedy draw keeps the projection's own argmax, as a pass without a draw does, so asking for log-probs never
changes a greedy answer.
"""
from __future__ import annotations

import logging

import numpy as np

from ..decode.sampling import Draw, LogProbs
from ..errors import GlanceError
from .device_buffers import Buffer, CudaDevice, Device
from .device_sampling import DeviceSampler

log = logging.getLogger("glance.sampling")


class RowDraws:
    """Draws over a logits buffer [rows, vocab] on `device`; `sampler`: what draws where the logits lie (a
    `DeviceSampler`'s interface), made on first use for a CUDA device where none is given."""

    def __init__(self, device: Device, sampler: DeviceSampler | None = None):
        self.device, self.sampler = device, sampler
        self.on_device = sampler is not None or isinstance(device, CudaDevice)

    def drawn(self, logits: Buffer, vocab: int, draw: Draw, rows: np.ndarray, depths: np.ndarray,
              argmax: np.ndarray, argmax_logp: np.ndarray) -> tuple[np.ndarray, np.ndarray, LogProbs | None]:
        """Each of `rows` (of the last projection's logits, `vocab` wide) at tree depths `depths`, with the
        projection's argmax and its log-prob: the token after the row (sampled, or that argmax where the draw is
        greedy), its log-prob under the untempered distribution, and the rows' report where the draw asks."""
        rows = np.asarray(rows, np.int64)
        if self.on_device and self._ready():
            got = self._on_device(logits, vocab, draw, rows, depths, argmax, argmax_logp)
            if got is not None:
                return got
        values = np.stack([self.device.download(logits.tensor((vocab,), int(r) * vocab * 4)) for r in rows])
        if draw.samples:
            chosen, confidence = draw.choose_with_logprob(values, depths, argmax, argmax_logp)
        else:
            chosen, confidence = argmax.astype(np.int64), argmax_logp.astype(np.float64)
        return chosen, confidence, draw.report(values, chosen) if draw.reports else None

    def _ready(self) -> bool:
        """Whether the device kernel serves draws: built on first use; where it cannot be, the host serves them from
        then on."""
        if self.sampler is None:
            self.sampler = DeviceSampler(self.device)
            try:
                self.sampler.load()
            except GlanceError as exc:
                log.warning("%s; sampling on the host instead (the same tokens, the logits copied per row)", exc)
                self.on_device = False
        return self.on_device

    def _on_device(self, logits: Buffer, vocab: int, draw: Draw, rows: np.ndarray, depths: np.ndarray,
                   argmax: np.ndarray, argmax_logp: np.ndarray) -> tuple[np.ndarray, np.ndarray, LogProbs | None] | None:
        """The kernel's draw; None where a greedy draw's kernel argmax parts from the projection's (a tie, or an
        engine's reduced-precision projection), which the host then reports for the projection's own token."""
        got = self.sampler.choose(logits.tensor((logits.shape[0], vocab)), rows, draw.first + np.asarray(depths),
                                  draw.params, draw.top_n or 0)
        if draw.samples:
            chosen, confidence = got.tokens, got.logprob
        elif np.array_equal(got.tokens, argmax):
            chosen, confidence = argmax.astype(np.int64), argmax_logp.astype(np.float64)
        else:
            return None
        report = LogProbs(got.logprob.astype(np.float32), got.top_ids, got.top) if draw.reports else None
        return chosen, confidence, report

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
