"""Random but well-formed inputs for each graph: used to trace the export and to validate it.

Validation must not reuse the trace's shapes, so every size is a parameter; trees are random
branching trees packed parents-first, with the visibility rule the runtime uses.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from glance_export.model.adapters import Snapshot
from glance_runtime.formats.graphs import draft_kv_names, target_kv_names
from glance_runtime.decode.tree import visibility

from . import eagle3_draft
from .spec import Dims
from glance_runtime.prompt.vision_indices import vision_index_inputs


def random_tree(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(depths, visible) of a random prefix-closed tree of `size` rows, root first."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, size)], dtype=np.int64)
    depths = np.zeros(size, np.int64)
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    return depths, visibility(parents)


def target_feed(dims: Dims, rng: np.random.Generator, rows: int, slots: list[int], past_lengths: list[int],
                pool: tuple[int, int], n_img: int, dtype: str, tree: bool) -> dict[str, np.ndarray]:
    """A pass of len(slots) sequences of `rows` rows each over its own past, read from a pool of pool[0] slots of
    pool[1] rows: prefill-like (causal masks, n_img image tokens among the batch's ids) or a random tree each."""
    batch = len(slots)
    ids = rng.integers(0, dims.vocab, size=(batch, rows), dtype=np.int64)
    if dims.image_token_id is not None:
        ids[ids == dims.image_token_id] = 0
        ids.reshape(-1)[rng.choice(batch * rows, size=min(n_img, batch * rows), replace=False)] = dims.image_token_id
    if tree:
        trees = [random_tree(rng, rows) for _ in range(batch)]
        depths, mask = np.stack([d for d, _ in trees]), np.stack([m for _, m in trees])
    else:
        depths = np.broadcast_to(np.arange(rows), (batch, rows))
        mask = np.broadcast_to(np.tri(rows, dtype=bool), (batch, rows, rows)).copy()
    stream = np.array(past_lengths, dtype=np.int64)[:, None] + depths
    feed: dict[str, np.ndarray] = {"input_ids": ids,
                                   "inputs_embeds": rng.normal(size=(batch, rows, dims.hidden)).astype(dtype)}
    if dims.is_vl:
        feed["image_embeds"] = rng.normal(size=(n_img, dims.hidden)).astype(dtype)
        if dims.deepstack:
            feed["deepstack_embeds"] = rng.normal(size=(dims.deepstack, n_img, dims.hidden)).astype(dtype)
        feed["position_ids"] = np.broadcast_to(stream, (3, batch, rows)).copy()
        if not tree:  # image rows get distinct h/w positions as a real prompt's do
            feed["position_ids"][1:] += rng.integers(0, 3, size=(2, batch, rows))
    else:
        feed["position_ids"] = stream
    feed.update(tree_mask=mask, **_pool_rows(slots, past_lengths))
    for name in target_kv_names(dims.layers)[0]:
        feed[name] = rng.normal(size=(*pool, dims.kv_heads, dims.head_dim)).astype(dtype)
    return feed


def draft_feed(dims: Dims, rng: np.random.Generator, context_lengths: list[int], rows: int, slots: list[int],
               past_lengths: list[int], pool: tuple[int, int], dtype: str,
               block: int | None = None) -> dict[str, np.ndarray]:
    """A draft pass of len(slots) sequences, each with `rows` context rows of which the first
    context_lengths[b] are real, appended after its own past, drafting `block` rows (default: the whole block)."""
    batch = len(slots)
    past = np.array(past_lengths, dtype=np.int64)
    feed = {"context_taps": (rng.normal(size=(batch, rows, dims.n_taps * dims.hidden)) * 4).astype(dtype),
            "context_positions": past[:, None] + np.arange(rows, dtype=np.int64)[None],
            "context_lengths": np.array(context_lengths, dtype=np.int64),
            "block_embeds": rng.normal(size=(batch, block or dims.block_size, dims.hidden)).astype(dtype),
            "start": past + np.array(context_lengths, dtype=np.int64), **_pool_rows(slots, past_lengths)}
    for name in draft_kv_names(dims.head_layers)[0]:
        feed[name] = rng.normal(size=(*pool, dims.head_kv_heads, dims.head_head_dim)).astype(dtype)
    return feed


def _pool_rows(slots: list[int], past_lengths: list[int]) -> dict[str, np.ndarray]:
    """The batch's slot and past inputs; `past_rows` spans the longest past."""
    return {"slots": np.array(slots, dtype=np.int64), "past_lengths": np.array(past_lengths, dtype=np.int64),
            "past_rows": np.arange(max(past_lengths), dtype=np.int64)}


def vocab_feed(dims: Dims, rng: np.random.Generator, ids: int, rows: int, dtype: str,
               vocab: int | None = None) -> dict[str, np.ndarray]:
    """Ids to embed (below `vocab`: the draft vocabulary's size for its graph) and hidden rows to project;
    rows are scaled like final-normed hidden states."""
    return {"ids": rng.integers(0, vocab or dims.vocab, size=(ids,), dtype=np.int64),
            "hidden": rng.normal(size=(rows, dims.hidden)).astype(dtype)}


def vision_feed(snapshot: Snapshot, dims: Dims, rng: np.random.Generator, width: int, height: int,
                dtype: str) -> dict[str, np.ndarray]:
    """Pixels of a random width x height image through the snapshot's own processor, plus index inputs."""
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = snapshot.image_processor(images=[Image.fromarray(pixels)], return_tensors="np")
    feed = {"pixel_values": np.asarray(out["pixel_values"], dtype=dtype)}
    return {**feed, **vision_index_inputs(np.asarray(out["image_grid_thw"]), dims.vision)}


def trace_feeds(snapshot: Snapshot, dims: Dims, dtype: str) -> dict[str, dict[str, np.ndarray]]:
    """Inputs to trace with: sizes distinct from each other and from 1, so no axis gets frozen (B 3 takes grouped
    attention's batched path, which serves every B; pool 7 x 9, T 4, S 5, N 2, N_img 2)."""
    rng = np.random.default_rng(0)
    feeds = {"target": target_feed(dims, rng, 4, [6, 0, 2], [2, 5, 3], (7, 9), 2, dtype, tree=False),
             "draft": (eagle3_draft.trace_feed(dims, rng, dtype) if dims.head_kind == "eagle3"
                       else draft_feed(dims, rng, [2, 1, 2], 2, [6, 0, 2], [2, 5, 3], (7, 9), dtype)),
             "vocab": vocab_feed(dims, rng, 4, 3, dtype)}
    if dims.draft_vocab:
        feeds["draft_vocab"] = vocab_feed(dims, rng, 4, 3, dtype, dims.draft_vocab)
    if dims.is_vl:
        feeds["vision"] = vision_feed(snapshot, dims, rng, 100, 80, dtype)
    return feeds
