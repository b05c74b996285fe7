"""Grid-derived index tensors of the vision graph, computed from `image_grid_thw` in plain numpy.

The HF vision towers derive rotary positions, attention windows and position-embedding resampling from
the image grid with Python loops, which a traced graph would freeze to one image size, so the exported
vision graph takes these tensors as inputs and the runtime computes them here; the exporter imports
this same module. `params` is the manifest's vision index params.

Inputs produced (N = patches = h * w of the grid, U = merge_size**2, M = N / U merged tokens):
    vision_pos_ids     i64[N, 2]  (row, column) of every patch, in the processor's merge-block order
    qwen2_5_vl: window_index i64[M] (merged tokens in window order), window_ids i64[N] (window of each
                patch row after that reordering), window_reverse i64[M] (the inverse permutation)
    qwen3_vl:   pos_interp_index i64[N, 4], pos_interp_weight f32[N, 4] (bilinear taps into the learned
                square position table, align_corners=True, border clamped)
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _grid(grid_thw: np.ndarray, merge: int) -> tuple[int, int]:
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if grid.shape[0] != 1 or int(grid[0, 0]) != 1:
        raise ValueError(f"the vision graph takes one image (grid_thw [[1, h, w]]), got {grid.tolist()}")
    h, w = int(grid[0, 1]), int(grid[0, 2])
    if h % merge or w % merge:
        raise ValueError(f"grid {h}x{w} is not a multiple of merge_size {merge}")
    return h, w


def _merge_order(values: np.ndarray, merge: int) -> np.ndarray:
    """Flatten an [h, w] map in merge-block order: block row, block column, row in block, column in block."""
    h, w = values.shape
    return values.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)


def position_ids(h: int, w: int, merge: int) -> np.ndarray:
    rows = np.broadcast_to(np.arange(h, dtype=np.int64)[:, None], (h, w))
    cols = np.broadcast_to(np.arange(w, dtype=np.int64)[None, :], (h, w))
    return np.stack([_merge_order(rows, merge), _merge_order(cols, merge)], axis=-1)


def window_indices(h: int, w: int, merge: int, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Qwen2.5-VL windows of `window` x `window` merged tokens, padded at the bottom/right edges."""
    gh, gw = h // merge, w // merge
    index = np.arange(gh * gw, dtype=np.int64).reshape(gh, gw)
    pad_h, pad_w = window - gh % window, window - gw % window
    padded = np.pad(index, ((0, pad_h), (0, pad_w)), constant_values=-1)
    nh, nw = padded.shape[0] // window, padded.shape[1] // window
    tiles = padded.reshape(nh, window, nw, window).transpose(0, 2, 1, 3).reshape(nh * nw, window * window)
    order = tiles[tiles >= 0]
    sizes = (tiles >= 0).sum(axis=1)
    window_ids = np.repeat(np.arange(nh * nw, dtype=np.int64), sizes * merge * merge)
    return order, window_ids, np.argsort(order, kind="stable").astype(np.int64)


def interp_taps(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners=True) taps of every patch into a side x side table, fp32 like the model."""
    rows = _merge_order(np.broadcast_to(np.arange(h)[:, None], (h, w)), merge)
    cols = _merge_order(np.broadcast_to(np.arange(w)[None, :], (h, w)), merge)

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        offsets = np.arange(2, dtype=np.float32)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets.astype(np.int64), 0, side - 1)
        weights = np.clip(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
        return taps, weights

    h_taps, h_w = axis(rows, h)
    w_taps, w_w = axis(cols, w)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4).astype(np.float32)
    return index, weight


def vision_index_inputs(grid_thw: np.ndarray, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The extra vision-graph inputs for one image grid, by input name."""
    merge = int(params["merge_size"])
    h, w = _grid(grid_thw, merge)
    out = {"vision_pos_ids": position_ids(h, w, merge)}
    if params["family"] == "qwen2_5_vl":
        window = int(params["window_size"]) // merge // int(params["patch_size"])
        out["window_index"], out["window_ids"], out["window_reverse"] = window_indices(h, w, merge, window)
    elif params["family"] == "qwen3_vl":
        out["pos_interp_index"], out["pos_interp_weight"] = interp_taps(h, w, merge, int(params["grid_per_side"]))
    return out
