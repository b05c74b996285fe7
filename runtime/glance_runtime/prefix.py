"""What a new prompt shares with the rows a backend has already committed, image by image.

A conversation's next prompt repeats the earlier turns, so its KV rows up to the first difference
are already on the device. Image tokens are one id repeated, so two prompts can agree token for
token while showing different pictures: an image counts as shared only when its pixels and grid are
the same too, and a shared prefix never ends inside an image (its rows come from one vision pass).
Both backends use these rules, the torch reference and the graph backend alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .preprocess import Prompt


@dataclass(frozen=True)
class ImageRun:
    start: int  # prompt index of the image's first token
    tokens: int  # its merged rows (= image tokens)
    patches: int  # its pixel_values rows
    grid: tuple[int, ...]  # its (t, h, w)
    pixels: np.ndarray = field(compare=False, repr=False)  # its pixel_values rows (a read-only view)

    def shows_same(self, other: "ImageRun") -> bool:
        """The same grid and the same pixels. Compared directly rather than through a digest: exact, and
        about ten times cheaper than hashing the pixels (which every prompt would pay, shared or not)."""
        return self.grid == other.grid and np.array_equal(self.pixels, other.pixels)


def image_runs(prompt: Prompt, image_token_id: int | None, merge: int) -> list[ImageRun]:
    """Each image's token run in prompt order (the processors place one run per image)."""
    if image_token_id is None or prompt.image_grid_thw is None:
        return []
    ids = np.asarray(prompt.input_ids).reshape(-1)
    runs, cursor, first_patch = [], 0, 0
    for grid in np.asarray(prompt.image_grid_thw, dtype=np.int64).reshape(-1, 3):
        patches = int(grid.prod())
        start = cursor + int(np.argmax(ids[cursor:] == image_token_id))
        pixels = prompt.pixel_values[first_patch:first_patch + patches].view()
        pixels.flags.writeable = False
        runs.append(ImageRun(start, patches // merge ** 2, patches, tuple(int(g) for g in grid), pixels))
        cursor, first_patch = start + patches // merge ** 2, first_patch + patches
    return runs


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
    """The prompt's images whose rows a prefill after `keep` kept rows must compute (None: none); `keep`
    must not fall inside an image."""
    runs = image_runs(prompt, image_token_id, merge)
    if any(run.start < keep < run.start + run.tokens for run in runs):
        raise ValueError(f"kept rows ({keep}) end inside an image; keep all of its rows or none")
    first = next((i for i, run in enumerate(runs) if run.start >= keep), None)
    if first is None:
        return None
    patch = sum(run.patches for run in runs[:first])
    return Prompt(prompt.input_ids, prompt.pixel_values[patch:], prompt.image_grid_thw[first:])
