"""Which sequences and anchors each optimizer step trains on: a function of the seed and the step alone.

One seeded global order (a fresh permutation every epoch) is cut into global batches; with N processes each
takes its contiguous slice of a step's batch. Anchors are drawn per (step, slot) from the seed, so a global
step sees the same samples and anchors whatever N is, and a resumed run, under any N, continues the order
exactly where it stopped without saving a generator.
"""
from __future__ import annotations

import random
from functools import lru_cache


@lru_cache(maxsize=4)
def _epoch(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"order/{seed}/{epoch}").shuffle(order)
    return tuple(order)


def step_items(seed: int, step: int, global_batch: int, n: int) -> list[int]:
    """The sequence indices of global step `step` (1-based), in slot order."""
    first = (step - 1) * global_batch
    return [_epoch(seed, p // n, n)[p % n] for p in range(first, first + global_batch)]


def rank_slots(global_batch: int, rank: int, world: int) -> range:
    """The contiguous slots of a global batch one process trains on."""
    per = global_batch // world
    return range(rank * per, (rank + 1) * per)


def anchors_for(seed: int, step: int, slot: int, first: int, last: int, count: int) -> list[int]:
    """`count` distinct anchors in rows first..last (fewer if the answer is shorter), ascending."""
    rows = range(first, last + 1)
    return sorted(random.Random(f"anchors/{seed}/{step}/{slot}").sample(rows, min(count, len(rows))))
