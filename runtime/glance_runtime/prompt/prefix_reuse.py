"""What a new prompt shares with the rows a backend has already committed, image by image (a video counts
as one image).

A conversation's next prompt repeats the earlier turns, so its KV rows up to the first difference
are already on the device. Image tokens are one id repeated, so two prompts can agree token for
token while showing different pictures: an image counts as shared only when its pixels and grid are
the same too (a video's also when its frame rate is, which places it in time), and a shared prefix
never ends inside an image or a video (their rows come from their vision passes).
Both backends use these rules, the torch reference and the graph backend alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .prompt_builder import Prompt


@dataclass(frozen=True)
class ImageRun:
    """One image's or one video's rows; a video's span also holds any text between its frame groups (Qwen3-VL
    writes a timestamp before each)."""

    start: int  # prompt index of its first token
    tokens: int  # rows from its first token to its last
    patches: int  # its pixel rows (of pixel_values, or of pixel_values_videos for a video)
    grid: tuple[int, ...]  # its (t, h, w)
    pixels: np.ndarray = field(compare=False, repr=False)  # its pixel rows (a read-only view)
    seconds: float | None = None  # a video's seconds per temporal patch (it places the video in time)
    video: bool = False
    offset: int = 0  # its first pixel row
    index: int = 0  # its grid row (among the images, or among the videos)

    def shows_same(self, other: "ImageRun") -> bool:
        """The same kind, grid, timing and pixels. Compared directly rather than through a digest: exact, and
        about ten times cheaper than hashing the pixels (which every prompt would pay, shared or not)."""
        return (self.video, self.grid, self.seconds) == (other.video, other.grid, other.seconds) \
            and np.array_equal(self.pixels, other.pixels)


def _token_runs(ids: np.ndarray, token: int) -> list[tuple[int, int]]:
    """(start, end) of every run of consecutive `token`s."""
    hit = np.concatenate([[False], ids == token, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _runs(ids: np.ndarray, token: int, grids: np.ndarray, pixels: np.ndarray, merge: int,
          seconds: np.ndarray | None, video: bool) -> list[ImageRun]:
    """Each grid's span: as many of the token's runs, in order, as hold its t*h*w/merge^2 tokens."""
    runs, pending, first_patch = [], _token_runs(ids, token), 0
    for i, grid in enumerate(grids):
        patches = int(grid.prod())
        need, start, end = patches // merge ** 2, None, None
        while need > 0 and pending:
            run_start, run_end = pending.pop(0)
            take = min(need, run_end - run_start)
            start = run_start if start is None else start
            end, need = run_start + take, need - take
            if run_start + take < run_end:
                pending.insert(0, (run_start + take, run_end))
        if need or start is None:
            raise ValueError(f"the prompt's {'video' if video else 'image'} tokens do not match the grids "
                             f"{grids.tolist()}")
        rows = pixels[first_patch:first_patch + patches].view()
        rows.flags.writeable = False
        runs.append(ImageRun(start, end - start, patches, tuple(int(g) for g in grid), rows,
                             None if seconds is None else float(seconds[i]), video, first_patch, i))
        first_patch += patches
    return runs


def image_runs(prompt: Prompt, image_token_id: int | None, merge: int) -> list[ImageRun]:
    """Each image's and each video's token span, in prompt order (the processors place one span per input)."""
    if image_token_id is None:
        return []
    ids = np.asarray(prompt.input_ids).reshape(-1)
    runs = []
    if prompt.image_grid_thw is not None:
        runs += _runs(ids, image_token_id, np.asarray(prompt.image_grid_thw, np.int64).reshape(-1, 3),
                      prompt.pixel_values, merge, None, False)
    if prompt.video_grid_thw is not None:
        runs += _runs(ids, prompt.video_token_id, np.asarray(prompt.video_grid_thw, np.int64).reshape(-1, 3),
                      prompt.pixel_values_videos, merge, prompt.second_per_grid_ts, True)
    return sorted(runs, key=lambda run: run.start)


@dataclass(frozen=True)
class Committed:
    """The token ids whose KV rows a backend holds, and the images among them."""

    ids: np.ndarray
    images: tuple[ImageRun, ...] = ()


def shared_rows(committed: Committed | None, prompt: Prompt, image_token_id: int | None, merge: int) -> int:
    """Rows of `prompt` a backend holding `committed` can keep: the longest common prefix, cut before the
    first image that differs or is only partly shared, and leaving at least the prompt's last token to run
    (its logits give the first answer token)."""
    if committed is None:
        return 0
    ids = np.asarray(prompt.input_ids).reshape(-1)
    limit = min(len(committed.ids), len(ids) - 1)
    differ = np.flatnonzero(committed.ids[:limit] != ids[:limit])
    keep = int(differ[0]) if len(differ) else limit
    old = {run.start: run for run in committed.images}
    for run in image_runs(prompt, image_token_id, merge):
        if run.start >= keep:
            break
        before = old.get(run.start)
        if before is None or not before.shows_same(run) or run.start + run.tokens > keep:
            return run.start
    return keep


def images_after(prompt: Prompt, keep: int, image_token_id: int | None, merge: int) -> Prompt | None:
    """The prompt's images and videos whose rows a prefill after `keep` kept rows must compute (None: none);
    `keep` must not fall inside one."""
    runs = image_runs(prompt, image_token_id, merge)
    if any(run.start < keep < run.start + run.tokens for run in runs):
        raise ValueError(f"kept rows ({keep}) end inside an image or video; keep all of its rows or none")
    if not any(run.start >= keep for run in runs):
        return None
    fields = {}
    for video, pixels, grids in ((False, "pixel_values", "image_grid_thw"),
                                 (True, "pixel_values_videos", "video_grid_thw")):
        first = next((run for run in runs if run.video == video and run.start >= keep), None)
        if first is not None:
            fields[pixels] = getattr(prompt, pixels)[first.offset:]
            fields[grids] = getattr(prompt, grids)[first.index:]
            if video:
                fields["second_per_grid_ts"] = prompt.second_per_grid_ts[first.index:]
    return Prompt(prompt.input_ids, **fields, video_token_id=prompt.video_token_id)
