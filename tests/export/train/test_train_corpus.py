"""The synthetic corpus is deterministic, its answers are what the pictures show, and prompts match inference."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from PIL import Image, ImageDraw

from glance_export.train import corpus
from glance_export.train.prompts import encode, image_processor_config
from glance_export.train.tokenizer import SPECIALS, train_tokenizer


def _pixels(s: corpus.Sample) -> np.ndarray:
    return np.asarray(s.image)


def test_same_seed_same_sample_and_seed_spaces_differ():
    a, b = corpus.training_sample(3, 17), corpus.training_sample(3, 17)
    assert (a.prompt, a.answer, a.kind) == (b.prompt, b.answer, b.kind)
    assert np.array_equal(_pixels(a), _pixels(b))
    held = corpus.heldout("receipt", 3)
    assert [s.answer for s in held] == [s.answer for s in corpus.heldout("receipt", 3)]
    train = {corpus.training_sample(0, i).image.tobytes() for i in range(40)}
    assert not any(s.image.tobytes() in train for s in corpus.heldout("scene", 10))


def test_every_kind_appears_and_images_are_small():
    kinds = {corpus.training_sample(0, i).kind for i in range(60)}
    assert kinds == set(corpus.KINDS)
    for kind in corpus.KINDS:
        assert corpus.heldout(kind, 1)[0].image.size == (corpus.IMAGE_SIZE, corpus.IMAGE_SIZE)


def test_receipt_total_is_the_number_drawn():
    for i in range(12):
        s = corpus.receipt(random.Random(i))
        if not s.prompt.startswith("What is the total"):
            continue
        total = s.answer.removeprefix("The total is ").removesuffix(".")
        redraw = Image.new("RGB", s.image.size, (255, 255, 255))
        corpus.cell_text(ImageDraw.Draw(redraw), 4, total, 36)
        assert np.array_equal(_pixels(s)[4 * corpus.CELL:], np.asarray(redraw)[4 * corpus.CELL:])


def test_chart_answers_match_bar_heights():
    for i in range(20):
        s = corpus.chart(random.Random(i))
        px = _pixels(s).astype(int)
        bar = np.zeros(px.shape[:2], bool)
        for rgb in corpus.COLOURS.values():
            bar |= (px == rgb).all(-1)
        values = [int(bar[:140, corpus.CELL * (k + 1) + corpus.CELL // 2].sum()) // 12 for k in range(4)]  # 12 px per unit
        if s.prompt == "Which bar is highest?":
            assert s.answer == f"Bar {corpus.BARS[int(np.argmax(values))]} is highest."
        elif s.prompt == "Which bar is lowest?":
            assert s.answer == f"Bar {corpus.BARS[int(np.argmin(values))]} is lowest."
        else:
            k = corpus.BARS.index(s.prompt[-2])
            assert s.answer.endswith(f" is {values[k]}.")


def _shape_of(mask: np.ndarray) -> str:
    """Name a filled shape from its pixels: bounding-box fill, then where its widest row lies."""
    rows, cols = np.nonzero(mask)
    box = mask[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    fill = box.mean()
    if fill > 0.9:
        return "square"
    if fill > 0.7:
        return "circle"
    widths = box.sum(1)
    return "triangle" if widths.argmax() > 0.8 * len(widths) else "diamond"


def test_scene_answers_match_pixels():
    half = corpus.IMAGE_SIZE // 2
    asked = set()
    for i in range(60):
        s = corpus.scene(random.Random(i))
        px = _pixels(s).astype(int)
        quads = {name: px[y * half:(y + 1) * half, x * half:(x + 1) * half] for name, (x, y) in corpus.CELLS.items()}
        masks = {(name, c): (np.abs(q - rgb).sum(-1) == 0) for name, q in quads.items()
                 for c, rgb in corpus.COLOURS.items()}
        painted = {name: {c for (n, c), m in masks.items() if n == name and m.any()} for name in quads}
        filled = {name for name, colours in painted.items() if colours}
        kind = s.prompt.split()[0]
        asked.add(kind)
        if kind == "How":
            assert str(len(filled)) in s.answer
        elif kind == "Where":
            colour = s.prompt.split()[3]
            cell = s.answer.split(" at the ")[1].rstrip(".")
            assert painted[cell] == {colour}
        else:
            cell = s.prompt.split(" at the ")[1].rstrip("?")
            (colour,) = painted[cell]
            if kind == "What":
                assert s.answer.endswith(f" is {colour}.")
            else:
                assert s.answer.endswith(f" is a {_shape_of(masks[cell, colour])}.")
    assert asked == {"How", "Where", "What", "Which"}


def test_scene_cover_map_marks_exactly_the_painted_pixels():
    for i in range(10):
        rng = random.Random(i)
        placed = corpus.scene_layout(rng)
        img, cover = corpus.scene_drawing(rng, placed)
        px, mark = np.asarray(img).astype(int), np.asarray(cover)
        for j, (_, _, colour) in enumerate(placed):
            painted = np.abs(px - corpus.COLOURS[colour]).sum(-1) == 0
            assert (mark == j + 1).any() and (painted[mark == j + 1]).all()
        background = px[mark == 0]
        assert all(not (np.abs(background - rgb).sum(-1) == 0).any() for rgb in corpus.COLOURS.values())


def test_caption_answers_name_colour_shape_and_background():
    for i in range(10):
        s = corpus.caption(random.Random(i))
        assert s.answer in s.answers and len(set(s.answers)) == len(corpus.CAPTIONS)
        bg = next(b for b in corpus.BACKGROUNDS if f"{b} background" in s.answer)
        colour = next(c for c in corpus.COLOURS if f" {c} " in s.answer)
        px = _pixels(s).astype(int)
        assert tuple(px[0, 0]) == corpus.BACKGROUNDS[bg]
        assert (np.abs(px - corpus.COLOURS[colour]).sum(-1) == 0).any()


def test_task_file_format(tmp_path):
    path = corpus.write_task_file(tmp_path / "chart", "chart", 4)
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        row = json.loads(line)
        assert {"image", "prompt", "answer"} <= set(row) and not row["image"].startswith("/")
        assert Image.open(path.parent / row["image"]).size == (corpus.IMAGE_SIZE, corpus.IMAGE_SIZE)
    assert corpus.read_task_file(path)[0]["image"].startswith("/")


@pytest.fixture(scope="module")
def processing(tmp_path_factory):
    from transformers import AutoImageProcessor

    d = tmp_path_factory.mktemp("proc")
    (d / "preprocessor_config.json").write_text(json.dumps(image_processor_config(corpus.IMAGE_SIZE)))
    return train_tokenizer(corpus.corpus_text(0, 300)), AutoImageProcessor.from_pretrained(d)


def test_tokenizer_has_qwen_specials_and_single_digits(processing):
    tok, _ = processing
    for s in SPECIALS:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1
    ids = tok("The total is 3.97.", add_special_tokens=False)["input_ids"]
    assert [t for t in tok.convert_ids_to_tokens(ids) if t.isdigit()] == ["3", "9", "7"]
    assert tok.decode(ids) == "The total is 3.97."


def test_prompt_expands_image_tokens_and_labels_only_the_answer(processing):
    tok, proc = processing
    s = corpus.heldout("scene", 1)[0]
    inputs = encode(tok, proc, s.image, s.prompt, s.answer)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    n_img = corpus.IMAGE_SIZE // 28 * (corpus.IMAGE_SIZE // 28)
    assert int(inputs["image_grid_thw"].prod()) // 4 == n_img
    assert int((inputs["input_ids"] == pad).sum()) == n_img
    assert inputs["mm_token_type_ids"].tolist() == (inputs["input_ids"] == pad).int().tolist()
    text = tok.decode(inputs["input_ids"][0])
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert f"<|vision_end|>{s.prompt}<|im_end|>\n<|im_start|>assistant\n{s.answer}<|im_end|>" in text
    answer = inputs["labels"][0][inputs["labels"][0] != -100]
    assert tok.decode(answer) == s.answer + "<|im_end|>"
    prompt_only = encode(tok, proc, s.image, s.prompt)
    n = prompt_only["input_ids"].shape[1]
    assert prompt_only["input_ids"][0].tolist() == inputs["input_ids"][0, :n].tolist()
    assert "labels" not in prompt_only
