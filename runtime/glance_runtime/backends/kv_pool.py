"""One KV allocation for every sequence of a batch: `[2 * layers, slots, max_context, kvh, D]`.

Each slot holds one sequence's committed rows. Within a layer a slot's rows are contiguous, so the
single-sequence graphs (prefill with its images, a decode alone) read and write a slot in place, exactly as
they do a `KVCache` of their own: a slot's cache is a `KVCache` whose layers lie `slots * max_context` rows
apart. A layer's whole pool is one contiguous tensor `[slots, max_context, kvh, D]`, which the batched graphs
take as it is, with the slots and lengths they serve. A sequence that joins or leaves touches only its slot.
"""
from __future__ import annotations

import numpy as np

from .device_buffers import Buffer, Device, Tensor
from .kv_cache import KVCache
from ..errors import GlanceError


class KVPool:
    """Keys and values of `layers` layers for `slots` sequences of up to `max_context` rows each."""

    def __init__(self, device: Device, layers: int, kv_heads: int, head_dim: int, slots: int, max_context: int,
                 dtype=np.float32):
        if slots < 1:
            raise GlanceError(f"--max-batch must be at least 1, got {slots}")
        self.device, self.layers, self.slots, self.max_context = device, layers, slots, int(max_context)
        self.row_shape = (kv_heads, head_dim)
        # a batched pass reads rows past a sequence's end (masked out), which must never hold NaN
        self.buffer: Buffer = device.zeros((2 * layers, slots, self.max_context, kv_heads, head_dim), dtype)
        self.row_bytes = kv_heads * head_dim * self.buffer.dtype.itemsize
        self.slot_bytes = self.max_context * self.row_bytes
        self.layer_bytes = slots * self.slot_bytes

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def cache(self, slot: int) -> KVCache:
        """Slot `slot`'s rows as a KVCache (the single-sequence graphs' view of it)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside a pool of {self.slots}")
        return KVCache(self.device, self.layers, *self.row_shape, self.max_context, self.buffer.dtype,
                       pool=(self.buffer, slot * self.slot_bytes, self.layer_bytes))

    def tensors(self) -> list[Tensor]:
        """Every layer's pool [slots, max_context, kvh, D], keys and values interleaved: the batched graphs' input."""
        shape = (self.slots, self.max_context, *self.row_shape)
        return [self.buffer.tensor(shape, i * self.layer_bytes) for i in range(2 * self.layers)]

    def write(self, slot: int, at: int, src: Buffer, src_offset: int, src_pitch: int, rows: int) -> None:
        """Rows `at..at+rows` of `slot`, in every layer at once, from `rows` consecutive rows of `src` whose layers
        lie `src_pitch` bytes apart (a batched pass's output): one strided copy."""
        if at + rows > self.max_context:
            raise GlanceError(f"context full: {at} committed rows + {rows} new exceed --max-context "
                              f"{self.max_context}; raise --max-context or lower --max-new-tokens")
        if rows:
            self.device.copy_strided(self.buffer, slot * self.slot_bytes + at * self.row_bytes, self.layer_bytes,
                                     src, src_offset, src_pitch, rows * self.row_bytes, 2 * self.layers)
