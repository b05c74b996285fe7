"""M-RoPE prefill positions for Qwen2-VL, Qwen2.5-VL and Qwen3-VL prompts, in numpy.

Text tokens advance one position on all three axes. Each run of image or video tokens takes (t, h, w)
positions on its merged grid, offset by the position where the run starts, and the text after it
resumes at that start plus the grid's longer spatial side. Runs take their grids in prompt order, one
kind at a time, as the families' own rope-index functions do. The families differ only for video:
Qwen2-VL steps the temporal axis by one per temporal patch, Qwen2.5-VL by `tokens_per_second` times the
seconds a temporal patch spans (truncated, in float32 as the model computes it), and Qwen3-VL places
each frame group as a still image of its own (its timestamp is text between them). The returned `delta`
(the prompt's last position + 1 - prompt length) is what every later stream position is shifted by: like
transformers' `generate`, the answer continues one past the prompt's last position, which a video's
temporal positions can exceed (for still images the last position is also the largest).
"""
from __future__ import annotations

import numpy as np

TOKENS_PER_SECOND = 4  # Qwen2.5-VL's vision config default


def video_grids(family: str, video_grid_thw: np.ndarray | None, second_per_grid_ts: np.ndarray | None,
                tokens_per_second: int = TOKENS_PER_SECOND) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Per run of video tokens, its grid and the temporal step between its temporal patches."""
    if video_grid_thw is None:
        return None, None
    grids = np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)
    if family == "qwen3_vl":
        split = np.repeat(grids, grids[:, 0], axis=0)
        split[:, 0] = 1
        return split, np.ones(len(split), np.float32)
    if family == "qwen2_5_vl":
        seconds = np.asarray(second_per_grid_ts, np.float32).reshape(-1)
        return grids, np.float32(tokens_per_second) * seconds
    return grids, np.ones(len(grids), np.float32)


def rope_index(input_ids: np.ndarray, image_token_id: int, image_grid_thw: np.ndarray | None,
               spatial_merge_size: int, video_token_id: int | None = None, video_grid_thw: np.ndarray | None = None,
               video_steps: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Positions int64 [3, 1, P] and delta for a prompt with any number of images and video runs (one grid
    row each; `video_grids` gives a video's runs and temporal steps)."""
    ids = np.asarray(input_ids).reshape(-1)
    length = ids.shape[0]
    kinds = np.zeros(length, np.int8)
    kinds[ids == image_token_id] = 1
    if video_token_id is not None and video_grid_thw is not None:
        kinds[ids == video_token_id] = 2
    if not kinds.any():
        return np.broadcast_to(np.arange(length, dtype=np.int64), (3, 1, length)).copy(), 0
    queues = {1: [(g, None) for g in np.asarray(image_grid_thw if image_grid_thw is not None else np.empty((0, 3)),
                                                dtype=np.int64).reshape(-1, 3).tolist()],
              2: list(zip(np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3).tolist(),
                          np.asarray(video_steps, np.float32).reshape(-1)))
              if video_grid_thw is not None else []}
    pos = np.empty((3, length), np.int64)
    edges = [0, *(np.flatnonzero(np.diff(kinds)) + 1).tolist(), length]
    current = 0
    for start, end in zip(edges[:-1], edges[1:]):
        kind = int(kinds[start])
        if kind == 0:
            pos[:, start:end] = np.arange(end - start) + current
            current += end - start
            continue
        while start < end:  # runs of one kind back to back take one grid each
            if not queues[kind]:
                raise ValueError(f"the prompt has more {'image' if kind == 1 else 'video'} tokens than its grids "
                                 "account for")
            (t, h, w), step = queues[kind].pop(0)
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            count = t * gh * gw
            if start + count > end:
                raise ValueError(f"expected a run of {count} {'image' if kind == 1 else 'video'} tokens for grid "
                                 f"{t}x{h}x{w} at prompt index {start}; the prompt's tokens do not match the grids")
            temporal = np.arange(t) if step is None else (np.arange(t, dtype=np.float32) * step).astype(np.int64)
            grid_t, grid_h, grid_w = np.meshgrid(temporal, np.arange(gh), np.arange(gw), indexing="ij")
            pos[:, start:start + count] = np.stack([grid_t.reshape(-1), grid_h.reshape(-1), grid_w.reshape(-1)]) + current
            current += max(gh, gw)
            start += count
    if any(queues.values()):
        raise ValueError("the prompt has fewer image or video tokens than its grids account for")
    return pos[:, None, :], int(pos[0, -1]) + 1 - length
