"""Preallocated, sequence-major KV caches on a device, for graph backends.

All layers' keys and values live in one allocation `[2 * layers, max_context, kvh, D]` (slot 2l is
layer l's keys, 2l+1 its values). Because rows are the second axis, a layer's committed prefix is the
contiguous block `[:S]` of its slot: graphs read it in place, a pass's new rows are written right
after it (the output is bound there), and committing a verified tree moves only the accepted rows
down, each with one strided copy across every slot. A round's device calls therefore depend on the
accepted path, never on the context length or the number of layers; memory never grows.
"""
from __future__ import annotations

import numpy as np

from .device_buffers import Buffer, Device, Tensor
from ..decode.limits import check_prompt
from ..errors import GlanceError, LimitError


class KVCache:
    """Keys and values of `layers` layers, listed as [key_0, value_0, key_1, ...] like the graphs."""

    def __init__(self, device: Device, layers: int, kv_heads: int, head_dim: int, max_context: int,
                 dtype=np.float32, pool: "tuple[Buffer, int, int] | None" = None):
        """`pool`: (buffer, byte offset, layer pitch) of rows in a KV pool to use instead of an allocation of
        its own (`kv_pool.KVPool.cache`): one sequence's rows there, every layer `pitch` bytes after the last."""
        if max_context < 1:
            raise GlanceError(f"--max-context must be at least 1, got {max_context}")
        self.device = device
        self.slots, self.max_context = 2 * layers, int(max_context)
        self.row_shape = (kv_heads, head_dim)
        self.row_bytes = kv_heads * head_dim * np.dtype(dtype).itemsize
        self.owned = pool is None  # whether close() frees the buffer
        if pool is None:
            self.buffer = device.empty((self.slots, self.max_context, kv_heads, head_dim), dtype)
            self.base, self.pitch = 0, self.max_context * self.row_bytes
        else:
            self.buffer, self.base, self.pitch = pool
        self.length = 0  # committed rows
        self._block_start = 0  # where the last appended block begins (what compact() selects from)

    def _rows(self, slot: int, first: int, count: int, lead: tuple[int, ...] = ()) -> Tensor:
        return self.buffer.tensor((*lead, count, *self.row_shape),
                                  self.base + slot * self.pitch + first * self.row_bytes)

    def past(self) -> list[Tensor]:
        """The committed rows of every slot, read in place by the next pass."""
        return [self._rows(s, 0, self.length) for s in range(self.slots)]

    def new_rows(self, rows: int, lead: tuple[int, ...] = ()) -> list[Tensor]:
        """Where a pass of `rows` rows writes its K/V: right after the committed rows of every slot (`lead`: axes
        before the rows, as a graph's batch of one has)."""
        self.check_room(rows)
        return [self._rows(s, self.length, rows, lead) for s in range(self.slots)]

    def check_room(self, rows: int) -> None:
        """Fail with the flag to change before a pass that would write past max_context."""
        if self.length + rows <= self.max_context:
            return
        if self.length == 0:
            self.check_prompt(rows)
        raise LimitError(f"context full: {self.length} committed rows + {rows} new exceed --max-context "
                          f"{self.max_context}; raise --max-context or lower --max-new-tokens")

    def check_prompt(self, rows: int) -> None:
        """Refuse a prompt of `rows` tokens that could never fit, whatever is committed now."""
        check_prompt(rows, self.max_context)

    def appended(self, rows: int) -> None:
        """The pass bound to `new_rows(rows)` has written them: they become the last block."""
        self.check_room(rows)
        self._block_start = self.length
        self.length += rows

    def compact(self, rows: np.ndarray) -> None:
        """Keep rows `rows` (ascending indices into the last block), packed right after the rows before it.

        Moved rows go in ascending order, one strided copy each (every slot at once): a row only ever
        moves down onto a row already copied or dropped, so no copy reads what another overwrote."""
        keep = [int(r) for r in rows]
        block = self.length - self._block_start
        if keep and (keep[0] < 0 or keep[-1] >= block or any(b <= a for a, b in zip(keep, keep[1:]))):
            raise ValueError(f"compact rows must be ascending indices into the last block, got {keep}")
        base = self.base + self._block_start * self.row_bytes
        for i, r in enumerate(keep):
            if r != i:
                self.device.copy_2d(self.buffer, base + i * self.row_bytes, base + r * self.row_bytes,
                                    self.row_bytes, self.slots, self.pitch)
        self.length = self._block_start + len(keep)

    def truncate(self, rows: int) -> None:
        """Keep only the first `rows` committed rows (a prompt that shares them); nothing moves."""
        if not 0 <= rows <= self.length:
            raise ValueError(f"cannot keep {rows} of {self.length} committed rows")
        self.length = self._block_start = rows

    def clear(self) -> None:
        """Forget every row (a new prompt); the buffer is reused, not reallocated."""
        self.length = 0
        self._block_start = 0

    def host_view(self) -> list[np.ndarray]:
        """The committed rows as host arrays, for tests and debugging (a download on a GPU)."""
        return [self.device.download(t) for t in self.past()]
