"""Train a GLANCE head for any supported target on its own greedy generations (the DFlash recipe).

For every task the target answers greedily; one forward pass over prompt + answer gives the tapped
hidden states of every row. A training example is an anchor inside the answer: block
`[anchor, MASK x (B-1)]` at positions `anchor .. anchor+B-1`, context = rows strictly before the
anchor, and offset k learns token `anchor + k` with weight `exp(-(k-1)/gamma)` (head_loss.py).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import DynamicCache

from glance_runtime.errors import GlanceError

from ..model.adapters import Prompt, Snapshot
from ..audit.greedy_audit import Task
from ..model.head import DraftHead, check_head_out, head_config_for, init_head, load_head, pick_mask_token, save_head
from ..model.torch_backend import TorchBackend, greedy_reference
from glance_runtime.formats.tasks import read as read_tasks
from .head_loss import Sequence, batch_loss, make_batch
from .checkpoint import capture, load_state, restore, run_signature, writer


@torch.no_grad()
def tap_rows(snapshot: Snapshot, model, prompt: Prompt, answer: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Taps of prompt + answer as decoding produces them: the prompt with its image, then the answer on
    the prompt's cache at positions `stream + delta`. Image features go to the prompt's image-pad rows
    only, so an answer that contains the image-pad id is embedded as the plain token, as in decoding."""
    reference = TorchBackend(snapshot, model=model)
    positions, delta = reference.prompt_positions(prompt)
    ids = torch.from_numpy(prompt.input_ids)[None]
    extra = {}
    if prompt.pixel_values is not None:
        extra = dict(pixel_values=torch.from_numpy(prompt.pixel_values).to(model.dtype),
                     image_grid_thw=torch.from_numpy(prompt.image_grid_thw),
                     mm_token_type_ids=(ids == snapshot.image_token_id).int())
    cache = DynamicCache(config=model.config)
    passes = [model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True,
                    **extra).hidden_states]
    if answer:
        stream = (torch.arange(prompt.length, prompt.length + len(answer)) + delta)[None]
        passes.append(model(input_ids=torch.tensor(answer)[None], cache=cache, use_cache=True,
                            position_ids=stream[None].expand(3, 1, -1) if snapshot.is_vl else stream,
                            output_hidden_states=True).hidden_states)
    return torch.cat([torch.cat([hidden[l + 1][0] for l in layer_ids], dim=-1) for hidden in passes]).float()


@torch.no_grad()
def collect_sequences(snapshot: Snapshot, model, tasks: list[Task], layer_ids: list[int], max_new_tokens: int,
                      progress: Callable[[str], None]) -> list[tuple[Sequence, torch.Tensor]]:
    """Generate each task's greedy answer, then tap the target over prompt + answer."""
    out = []
    for i, task in enumerate(tasks, 1):
        prompt = snapshot.build_prompt(task.prompt, task.image)
        answer = greedy_reference(model, snapshot, prompt, max_new_tokens, snapshot.stop_token_ids)
        ids = torch.cat([torch.from_numpy(prompt.input_ids), torch.tensor(answer, dtype=torch.long)])
        out.append((Sequence(ids, prompt.length), tap_rows(snapshot, model, prompt, answer, layer_ids)))
        if i % 20 == 0 or i == len(tasks):
            progress(f"generated {i}/{len(tasks)} answers")
    return out


MADE_BY = "glance-export train-head"


def train_head(model_dir: str | Path, task_file: str | Path, out_dir: str | Path, *, layers: int = 1,
               block_size: int = 16, steps: int = 2000, lr: float = 3e-3, batch: int = 8, anchors: int = 16,
               gamma: float = 7.0, max_new_tokens: int = 64, seed: int = 0, time_budget_s: float | None = None,
               resume: str | Path | None = None, checkpoint_every: int = 500,
               progress: Callable[[str], None] = print) -> Path:
    """Train (or continue) a head; returns the saved head directory.

    Every `checkpoint_every` steps the head and the trainer state are written to `out_dir` together;
    the same command run again after an interruption continues from there. The finished head holds
    no trainer state (a run stopped by its time budget keeps it, so it can be continued)."""
    check_head_out(out_dir, (model_dir, task_file, resume))
    tasks = read_tasks(task_file)
    if checkpoint_every < 1:
        raise GlanceError(f"--checkpoint-every must be at least 1, got {checkpoint_every}; pass a positive step count")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    snapshot = Snapshot(model_dir)
    signature = run_signature(snapshot.path, Path(task_file), layers=layers, block_size=block_size, steps=steps,
                              lr=lr, batch=batch, anchors=anchors, gamma=gamma, max_new_tokens=max_new_tokens,
                              seed=seed, resume=resume)
    state = load_state(Path(out_dir), signature)
    model = snapshot.load_model("float32")
    for p in model.parameters():
        p.requires_grad_(False)
    if state is not None:
        head = load_head(out_dir).train()
    elif resume is not None:
        head = load_head(resume).train()
    else:
        head = init_head(head_config_for(snapshot, layers, block_size, pick_mask_token(snapshot)), seed).train()
    cfg = head.config
    progress(f"stage 1/2: target answers and taps of layers {cfg.target_layer_ids}")
    seqs = [s for s in collect_sequences(snapshot, model, tasks, cfg.target_layer_ids, max_new_tokens,
                                         progress) if s[0].ids.shape[0] - s[0].answer_start >= 2]
    if not seqs:
        raise GlanceError("the target produced no answer longer than one token; nothing to train on")
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    done = 0
    if state is not None:
        done = restore(state, opt, sched, rng)
        progress(f"resuming from the checkpoint in {out_dir} at step {done}")
    progress(f"stage 2/2: {steps} steps on {len(seqs)} sequences, block {cfg.block_size}")
    t0 = time.time()
    for step in range(done + 1, steps + 1):
        opt.zero_grad()
        chosen = rng.sample(seqs, min(batch, len(seqs)))
        picks = []
        for seq, _ in chosen:
            lo, hi = seq.answer_start, seq.ids.shape[0] - 2
            picks.append(sorted(rng.sample(range(lo, hi + 1), min(anchors, hi - lo + 1))))
        stats = batch_loss(head, embed, lm_head, make_batch([s for s, _ in chosen], [t for _, t in chosen], picks),
                           gamma)
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step
        if step % 50 == 0 or step == steps:
            progress(f"step {step}/{steps} loss {stats.loss.item():.4f} offset-1 acc "
                     f"{stats.hits[0].item() / max(1, stats.counts[0].item()):.3f} "
                     f"({time.time() - t0:.0f}s)")
        if step % checkpoint_every == 0 and step < steps:
            save_head(head.eval(), out_dir, also=writer(capture(signature, step, opt, sched, rng)), made_by=MADE_BY)
            head.train()
            progress(f"checkpoint at step {step}")
        if time_budget_s is not None and time.time() - t0 > time_budget_s:
            progress(f"time budget reached after {step} steps")
            break
    unfinished = writer(capture(signature, done, opt, sched, rng)) if done < steps else None
    out = save_head(head.eval(), out_dir, also=unfinished, made_by=MADE_BY)
    progress(f"saved head to {out} after {done} steps")
    return out
