"""M-RoPE prefill positions for Qwen2-VL, Qwen2.5-VL and Qwen3-VL prompts, in numpy.

Text tokens advance one position on all three axes; an image's tokens take (t, h, w) positions on
its merged grid, offset by the position where the image starts, and the text after it resumes at
that offset plus the grid's longer side. The returned `delta` (last position + 1 - prompt length)
is what every later stream position is shifted by. For still images the three families agree
(they differ only for video), so one function serves all of them.
"""
from __future__ import annotations

import numpy as np


def rope_index(input_ids: np.ndarray, image_token_id: int, image_grid_thw: np.ndarray | None,
               spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """Positions int64 [3, 1, P] and delta for a prompt with at most one image (one run of image tokens)."""
    ids = np.asarray(input_ids).reshape(-1)
    length = ids.shape[0]
    is_image = ids == image_token_id
    if image_grid_thw is None or not is_image.any():
        return np.broadcast_to(np.arange(length, dtype=np.int64), (3, 1, length)).copy(), 0
    first = int(np.argmax(is_image))
    t, h, w = (int(x) for x in np.asarray(image_grid_thw).reshape(-1, 3)[0])
    gh, gw = h // spatial_merge_size, w // spatial_merge_size
    n_image = t * gh * gw
    if not is_image[first:first + n_image].all() or is_image.sum() != n_image:
        raise ValueError(f"expected one run of {n_image} image tokens for grid {t}x{h}x{w}, "
                         f"got {int(is_image.sum())} image tokens")
    grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
    image_pos = np.stack([grid_t.reshape(-1), grid_h.reshape(-1), grid_w.reshape(-1)]) + first
    after = first + max(gh, gw)
    tail = np.arange(length - first - n_image) + after
    pos = np.concatenate([np.broadcast_to(np.arange(first), (3, first)), image_pos,
                          np.broadcast_to(tail, (3, tail.shape[0]))], axis=1).astype(np.int64)
    delta = int(pos.max()) + 1 - length
    return pos[:, None, :], delta
