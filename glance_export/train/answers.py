"""The target's own greedy answers to training prompts, generated in padded batches, and the hidden states the
head reads over prompt + answer.

The head must learn the target's distribution, so every answer is regenerated here (never taken from the
data). Batches group prompts of similar length to keep padding small; each prompt is left-padded so every
row's next token comes from the last column, and transformers' `generate` places the images and their
M-RoPE positions by the attention mask.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from ..model.adapters import Prompt, Snapshot
from ..model.torch_backend import TorchBackend, vision_inputs


def _batch_inputs(snapshot: Snapshot, prompts: Sequence[Prompt], device: torch.device, dtype: torch.dtype) -> dict:
    rows = max(p.length for p in prompts)
    ids = torch.zeros(len(prompts), rows, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, rows - p.length:] = torch.from_numpy(p.input_ids)
        mask[i, rows - p.length:] = 1
    ids, mask = ids.to(device), mask.to(device)
    out = dict(input_ids=ids, attention_mask=mask)
    with_images = [p for p in prompts if p.pixel_values is not None]
    if with_images:
        out.update(pixel_values=torch.cat([torch.from_numpy(p.pixel_values) for p in with_images]).to(device, dtype),
                   image_grid_thw=torch.cat([torch.from_numpy(p.image_grid_thw) for p in with_images]).to(device),
                   mm_token_type_ids=(ids == snapshot.image_token_id).int() * mask)
    return out


def _trim(tokens: list[int], stops: set[int]) -> list[int]:
    """Up to and including the first stop token (generate pads the rows that stopped early)."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


@torch.no_grad()
def generate_answers(model, snapshot: Snapshot, prompts: Sequence[Prompt], max_new_tokens: int, batch: int,
                     progress: Callable[[int], None] = lambda done: None) -> list[list[int]]:
    """Greedy answers of `prompts`, in their order, `batch` prompts a pass."""
    stops = set(snapshot.stop_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].length)
    answers: list[list[int]] = [[] for _ in prompts]
    for lo in range(0, len(order), batch):
        chunk = order[lo:lo + batch]
        inputs = _batch_inputs(snapshot, [prompts[i] for i in chunk], model.device, model.dtype)
        if snapshot.is_vl:
            model.model.rope_deltas = None  # cached per call by the model; a stale one shifts positions
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             eos_token_id=sorted(stops), pad_token_id=0, temperature=None, top_p=None, top_k=None)
        width = inputs["input_ids"].shape[1]
        for row, i in enumerate(chunk):
            answers[i] = _trim(out[row, width:].tolist(), stops)
        progress(min(lo + batch, len(order)))
    return answers


@torch.no_grad()
def tap_rows(snapshot: Snapshot, model, prompt: Prompt, answer: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Taps [rows, n_taps * H] of prompt + answer as decoding produces them: the prompt with its images, then
    the answer on the prompt's cache at positions `stream + delta`. Image features go to the prompt's
    image-pad rows only, so an answer that contains the image-pad id is embedded as the plain token, as in
    decoding."""
    device = model.device
    reference = TorchBackend(snapshot, model=model, device=str(device))
    positions, delta = reference.prompt_positions(prompt)
    ids = torch.from_numpy(prompt.input_ids)[None].to(device)
    cache = DynamicCache(config=model.config)
    passes = [model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True,
                    **vision_inputs(snapshot, prompt, ids, device, model.dtype)).hidden_states]
    if answer:
        stream = (torch.arange(prompt.length, prompt.length + len(answer), device=device) + delta)[None]
        passes.append(model(input_ids=torch.tensor(answer, device=device)[None], cache=cache, use_cache=True,
                            position_ids=stream[None].expand(3, 1, -1) if snapshot.is_vl else stream,
                            output_hidden_states=True).hidden_states)
    return torch.cat([torch.cat([hidden[l + 1][0] for l in layer_ids], dim=-1) for hidden in passes])
