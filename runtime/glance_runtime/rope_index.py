"""M-RoPE prefill positions for Qwen2-VL, Qwen2.5-VL and Qwen3-VL prompts, in numpy.

Text tokens advance one position on all three axes; each image's tokens take (t, h, w) positions on
its merged grid, offset by the position where that image starts, and the text after it resumes one
past the largest position the image used (its start plus the grid's longer side, for a still image).
Images are consumed in prompt order, one grid each, as the families' own rope-index functions do.
The returned `delta` (last position + 1 - prompt length) is what every later stream position is
shifted by. For still images the three families agree (they differ only for video), so one function
serves all of them.
"""
from __future__ import annotations

import numpy as np


def rope_index(input_ids: np.ndarray, image_token_id: int, image_grid_thw: np.ndarray | None,
               spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """Positions int64 [3, 1, P] and delta for a prompt with any number of images (one grid row each)."""
    ids = np.asarray(input_ids).reshape(-1)
    length = ids.shape[0]
    is_image = ids == image_token_id
    if image_grid_thw is None or not is_image.any():
        return np.broadcast_to(np.arange(length, dtype=np.int64), (3, 1, length)).copy(), 0
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    pos = np.empty((3, length), np.int64)
    cursor, next_pos = 0, 0  # next prompt index to place, and the position it takes if it is text
    for t, h, w in grids.tolist():
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        n_image = t * gh * gw
        rest = np.flatnonzero(is_image[cursor:])
        if not len(rest) or not is_image[cursor + rest[0]:cursor + rest[0] + n_image].all() \
                or cursor + rest[0] + n_image > length:
            raise ValueError(f"expected a run of {n_image} image tokens for grid {t}x{h}x{w} after prompt index "
                             f"{cursor}; the prompt's image tokens do not match image_grid_thw {grids.tolist()}")
        first = cursor + int(rest[0])
        pos[:, cursor:first] = np.arange(first - cursor) + next_pos
        start = next_pos + first - cursor
        grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, first:first + n_image] = np.stack([grid_t.reshape(-1), grid_h.reshape(-1), grid_w.reshape(-1)]) + start
        cursor, next_pos = first + n_image, start + max(t, gh, gw)
    if is_image[cursor:].any():
        raise ValueError(f"the prompt has {int(is_image.sum())} image tokens, more than image_grid_thw "
                         f"{grids.tolist()} accounts for")
    pos[:, cursor:] = np.arange(length - cursor) + next_pos
    delta = int(pos.max()) + 1 - length
    return pos[:, None, :], delta
