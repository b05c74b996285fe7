"""Vision warmup: supervise the fresh vision tower directly before the language model trains.

From scratch, the answer loss alone barely reaches the vision tower until the language model
attends to the right image tokens, and it will not attend until their features carry the answer:
the run sits on the answer-template loss (measured: digits, shapes and positions all stall). A
short auxiliary phase breaks that loop. Throwaway linear probes read the merged image tokens:
per cell (the digit centred in it; in charts, each label cell's letter, bar value and rank; in
scenes, the quadrant the cell lies in and the shape and colour covering it, so the language
model can find a shape by content and read its place off the same token), per image quadrant
(mean of its cells: shape and colour there) and per image (mean of all cells: shape, colour and
background of a lone shape). Only the vision tower's weights are kept.
"""
from __future__ import annotations

import random
import time

import numpy as np
import torch
from PIL import Image, ImageDraw

from glance_export.train import corpus
from glance_export.train.corpus import BACKGROUNDS, CELL, CELLS, COLOURS, IMAGE_SIZE, SHAPES, font

SIDE = IMAGE_SIZE // CELL
NO_DIGIT = 10
# head -> (pooling, classes); quadrant heads use class 0 for an empty quadrant
HEADS = {"digit": ("cell", 11), "rank": ("cell", 3), "letter": ("cell", 4), "bar_value": ("cell", 10),
         "cell_quad": ("cell", 4), "cell_shape": ("cell", len(SHAPES) + 1), "cell_colour": ("cell", len(COLOURS) + 1),
         "quad_shape": ("quad", len(SHAPES) + 1), "quad_colour": ("quad", len(COLOURS) + 1),
         "shape": ("image", len(SHAPES)),
         "colour": ("image", len(COLOURS)), "background": ("image", len(BACKGROUNDS))}
EMPTY = {"digit": NO_DIGIT, "cell_shape": 0, "cell_colour": 0}  # left out of the logged accuracies
Labels = dict[str, list[int]]


def glyph_grid(rng: random.Random) -> tuple[Image.Image, Labels]:
    """Digits in random cells of the merged-token grid, in till-like sizes."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    digits = []
    for row in range(SIDE):
        for col in range(SIDE):
            if rng.random() < 0.4:
                d = rng.randrange(10)
                xy = (col * CELL + CELL // 2 + rng.randint(-4, 4), row * CELL + CELL // 2 + rng.randint(-3, 3))
                draw.text(xy, str(d), fill=(0, 0, 0), font=font(rng.randint(24, 38)), anchor="mm")
                digits.append(d)
            else:
                digits.append(NO_DIGIT)
    return img, {"digit": digits}


def chart_cells(rng: random.Random) -> tuple[Image.Image, Labels]:
    """A corpus chart: value digits in the top row; each label cell learns its letter, its bar's
    value and whether that bar is highest (1) or lowest (2), so one content lookup answers."""
    values = rng.sample(range(1, 10), 4)
    img = corpus.chart_image(values, rng.choice(list(COLOURS)))
    digit = [NO_DIGIT] * SIDE * SIDE
    rank, letter, bar_value = ([-100] * SIDE * SIDE for _ in range(3))
    for i, v in enumerate(values):
        digit[i + 1] = v
        at = (SIDE - 1) * SIDE + i + 1
        rank[at] = 1 if v == max(values) else 2 if v == min(values) else 0
        letter[at], bar_value[at] = i, v
    return img, {"digit": digit, "rank": rank, "letter": letter, "bar_value": bar_value}


def scene_quads(rng: random.Random) -> tuple[Image.Image, Labels]:
    """A corpus scene: per quadrant its shape and colour (0: empty); per cell its quadrant and the
    shape and colour covering at least a fifth of it (0: none)."""
    placed = corpus.scene_layout(rng)
    img, cover = corpus.scene_drawing(rng, placed)
    shape, colour = [0] * 4, [0] * 4
    for s, cell, c in placed:
        x, y = CELLS[cell]
        shape[2 * y + x], colour[2 * y + x] = SHAPES.index(s) + 1, list(COLOURS).index(c) + 1
    cells = np.asarray(cover).reshape(SIDE, CELL, SIDE, CELL).transpose(0, 2, 1, 3).reshape(SIDE * SIDE, -1)
    cell_quad, cell_shape, cell_colour = [], [], []
    for i, pixels in enumerate(cells):
        row, col = divmod(i, SIDE)
        cell_quad.append(2 * (row >= SIDE // 2) + (col >= SIDE // 2))
        counts = np.bincount(pixels, minlength=len(placed) + 1)
        top = int(counts[1:].argmax()) if len(placed) else 0
        if len(placed) and counts[top + 1] >= pixels.size // 5:
            s, _, c = placed[top]
            cell_shape.append(SHAPES.index(s) + 1)
            cell_colour.append(list(COLOURS).index(c) + 1)
        else:
            cell_shape.append(0)
            cell_colour.append(0)
    return img, {"quad_shape": shape, "quad_colour": colour, "cell_quad": cell_quad, "cell_shape": cell_shape,
                 "cell_colour": cell_colour}


def lone_shape(rng: random.Random) -> tuple[Image.Image, Labels]:
    """A corpus caption image with its shape, colour and background."""
    bg, colour, shape = rng.choice(list(BACKGROUNDS)), rng.choice(list(COLOURS)), rng.choice(SHAPES)
    return corpus.caption_image(rng, bg, colour, shape), {
        "shape": [SHAPES.index(shape)], "colour": [list(COLOURS).index(colour)],
        "background": [list(BACKGROUNDS).index(bg)]}


SOURCES = (glyph_grid, chart_cells, scene_quads, lone_shape)


def _pool(feats: torch.Tensor, how: str) -> torch.Tensor:
    """Merged-token features (B*36, H) pooled to cells, quadrants (row-major) or whole images."""
    grid = feats.view(-1, SIDE, SIDE, feats.shape[-1])
    if how == "cell":
        return feats
    if how == "quad":
        h = SIDE // 2
        return grid.view(-1, 2, h, 2, h, feats.shape[-1]).mean((2, 4)).reshape(-1, feats.shape[-1])
    return grid.mean((1, 2))


def warmup_vision(model, image_processor, *, steps: int, seed: int, batch_size: int = 16, lr: float = 2e-3,
                  log_every: int = 100) -> dict[str, float]:
    """Train `model.model.visual` with the probes for `steps` steps; returns last-batch probe accuracies."""
    visual = model.model.visual
    width = visual.config.out_hidden_size
    probes = torch.nn.ModuleDict({k: torch.nn.Linear(width, n) for k, (_, n) in HEADS.items()})
    params = list(visual.parameters()) + list(probes.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sizes = {"cell": SIDE * SIDE, "quad": 4, "image": 1}
    start, acc = time.time(), {}
    for step in range(steps):
        pairs = [SOURCES[j % len(SOURCES)](random.Random(f"warmup:{seed}:{step}:{j}")) for j in range(batch_size)]
        vision = image_processor(images=[p[0] for p in pairs], return_tensors="pt")
        feats = visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"]).pooler_output
        loss = torch.zeros(())
        for k, (how, _) in HEADS.items():
            labels = torch.tensor([c for _, lab in pairs for c in lab.get(k, [-100] * sizes[how])])
            logits = probes[k](_pool(feats, how))
            loss = loss + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
            shown = (labels >= 0) & (labels != EMPTY.get(k, -1))
            acc[k] = (logits.argmax(-1)[shown] == labels[shown]).float().mean().item()
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % log_every == 0:
            accs = " ".join(f"{k} {v:.2f}" for k, v in acc.items())
            print(f"warmup {step + 1}/{steps} loss {loss.item():.3f} acc {accs} {time.time() - start:.0f}s",
                  flush=True)
    return acc
