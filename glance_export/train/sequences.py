"""Stage 1 of training: the data's samples as prompts, the target's answers to them, and the rows the head
trains on. Under torchrun each process answers its share and all processes end with every sequence.

A sample whose prompt cannot be built (a missing or broken image, a template that refuses its turns) or
that leaves no room for an answer within the target's positions is skipped and counted with its reason.
"""
from __future__ import annotations

from typing import Callable

import torch

from glance_runtime.errors import GlanceError

from ..model.adapters import Prompt, Snapshot
from .answers import generate_answers
from .data_files import Sample, Tally
from .head_loss import Sequence
from .world import World

# prompts built (images decoded) at a time: bounds the pixels held while answers are generated
WINDOW_BATCHES = 8


def prompt_of(snapshot: Snapshot, sample: Sample) -> Prompt:
    return snapshot.build_messages(sample.messages)


def _checked(snapshot: Snapshot, sample: Sample, max_new_tokens: int) -> Prompt | str:
    """The sample's prompt, or why it cannot be used."""
    try:
        prompt = prompt_of(snapshot, sample)
    except GlanceError as exc:
        return str(exc)
    positions = snapshot.text_config.get("max_position_embeddings")
    if isinstance(positions, int) and prompt.length + max_new_tokens > positions:
        return f"prompt of {prompt.length} tokens leaves no room for {max_new_tokens} answer tokens in {positions}"
    return prompt


def answer_samples(snapshot: Snapshot, model, samples: list[Sample], max_new_tokens: int, batch: int, world: World,
                   tally: Tally, progress: Callable[[str], None]) -> tuple[list[Sequence], dict[int, torch.Tensor]]:
    """Every usable sample as a Sequence, in sample order, and its ids (prompt + the target's greedy answer) by
    sample; skipped samples are added to `tally` (on every process)."""
    mine = list(range(world.rank, len(samples), world.size))
    done: list[tuple[int, list[int], int] | tuple[int, str]] = []
    window = batch * WINDOW_BATCHES
    for lo in range(0, len(mine), window):
        prompts: list[tuple[int, Prompt]] = []
        for i in mine[lo:lo + window]:
            checked = _checked(snapshot, samples[i], max_new_tokens)
            if isinstance(checked, str):
                done.append((i, checked))
            else:
                prompts.append((i, checked))
        try:
            answers = generate_answers(model, snapshot, [p for _, p in prompts], max_new_tokens, batch)
        except torch.OutOfMemoryError:
            raise GlanceError(f"out of memory on {model.device} while generating answers {batch} prompts at a "
                              "time; lower --gen-batch (or --max-new-tokens)") from None
        for (i, prompt), answer in zip(prompts, answers):
            done.append((i, prompt.input_ids.tolist() + answer, prompt.length))
        if world.main:
            progress(f"answered {min(lo + window, len(mine))}/{len(mine)} prompts"
                     + (f" on each of {world.size} processes" if world.size > 1 else ""))
    results = sorted((r for part in world.gather(done) for r in part), key=lambda r: r[0])
    seqs, ids = [], {}
    for r in results:
        if len(r) == 2:
            tally.skip(samples[r[0]].where, r[1])
        else:
            seqs.append(Sequence(len(r[1]), r[2], r[0]))
            ids[r[0]] = torch.tensor(r[1], dtype=torch.long)
    return seqs, ids
