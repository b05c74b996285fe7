"""Vision warmup: teach the fresh vision tower to recognise digits before the language model trains.

From scratch, the answer loss alone barely reaches the vision tower until the language model
attends to the right image token, and it will not attend until the features carry the digit: the
run sits on the answer-template loss. A short auxiliary phase breaks that loop: every merged
image token classifies the digit centred in its 28 px cell (or none), through a throwaway linear
probe. Only the vision tower's weights are kept.
"""
from __future__ import annotations

import random
import time

import torch
from PIL import Image, ImageDraw

from glance_export.train.corpus import CELL, IMAGE_SIZE, font

NONE = 10  # class of a cell without a digit


def glyph_grid(rng: random.Random) -> tuple[Image.Image, list[int]]:
    """An image with digits in random cells of the merged-token grid, and each cell's class."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    side = IMAGE_SIZE // CELL
    labels = []
    for row in range(side):
        for col in range(side):
            if rng.random() < 0.4:
                d = rng.randrange(10)
                xy = (col * CELL + CELL // 2 + rng.randint(-4, 4), row * CELL + CELL // 2 + rng.randint(-3, 3))
                draw.text(xy, str(d), fill=(0, 0, 0), font=font(rng.randint(24, 38)), anchor="mm")
                labels.append(d)
            else:
                labels.append(NONE)
    return img, labels


def warmup_vision(model, image_processor, *, steps: int, seed: int, batch_size: int = 16, lr: float = 2e-3,
                  log_every: int = 50) -> float:
    """Train `model.model.visual` on glyph grids for `steps` steps; returns the last batch's digit accuracy."""
    visual = model.model.visual
    probe = torch.nn.Linear(visual.config.out_hidden_size, NONE + 1)
    params = list(visual.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    start, acc = time.time(), 0.0
    for step in range(steps):
        pairs = [glyph_grid(random.Random(f"glyph:{seed}:{step}:{j}")) for j in range(batch_size)]
        vision = image_processor(images=[p[0] for p in pairs], return_tensors="pt")
        labels = torch.tensor([c for p in pairs for c in p[1]])
        feats = visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"]).pooler_output
        logits = probe(feats)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        digit = labels != NONE
        acc = (logits.argmax(-1)[digit] == labels[digit]).float().mean().item()
        if (step + 1) % log_every == 0:
            print(f"warmup {step + 1}/{steps} loss {loss.item():.4f} digit acc {acc:.3f} "
                  f"{time.time() - start:.0f}s", flush=True)
    return acc
