"""Prompt construction shared by training and evaluation, so both see identical token streams.

AutoProcessor cannot load without torchvision (its video processor needs it), so the chat template,
the image processor and the `<|image_pad|>` expansion are composed here by hand.
"""
from __future__ import annotations

import torch
from PIL import Image

PATCH, MERGE = 14, 2


def image_processor_config(size: int) -> dict:
    """Qwen2VLImageProcessor settings that keep a `size` x `size` image at its own resolution."""
    unit = PATCH * MERGE
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "temporal_patch_size": 2,
            "merge_size": MERGE, "min_pixels": unit * unit, "max_pixels": size * size,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


def encode(tokenizer, image_processor, image: Image.Image, prompt: str, answer: str | None = None) -> dict:
    """Token ids, image inputs and (with `answer`) labels for one user turn with one image.

    The answer is tokenized apart from the prompt and closed with `<|im_end|>`: exactly the tokens
    greedy decoding must produce after the generation prompt. Labels are -100 outside the answer.
    """
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    vision = image_processor(images=[image], return_tensors="pt")
    grid = vision["image_grid_thw"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    n_img = int(grid.prod()) // MERGE**2
    expanded: list[int] = []
    for t in ids:
        expanded.extend([pad] * n_img if t == pad else [t])
    n_prompt = len(expanded)
    if answer is not None:
        expanded += tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([expanded])
    out = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
           "mm_token_type_ids": (input_ids == pad).int(), "pixel_values": vision["pixel_values"],
           "image_grid_thw": grid}
    if answer is not None:
        labels = input_ids.clone()
        labels[:, :n_prompt] = -100
        out["labels"] = labels
    return out
