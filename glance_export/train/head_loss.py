"""The training step's loss: several sequences and all their anchors in one padded forward.

A training example is an anchor inside a target answer: block `[anchor, MASK x (B-1)]` at positions
`anchor .. anchor+B-1` sees the context rows strictly before the anchor, and offset k learns token
`anchor + k` with weight `exp(-(k-1)/gamma)`. The anchors of one sequence share its context K/V: their
blocks are laid side by side as the query rows of one pass, a context mask hides the rows at or after
each anchor (and the padding past a shorter sequence), and a block mask keeps the blocks apart. The loss
is each sequence's weighted mean over its anchors, averaged over the sequences, so a batch scores each
sequence exactly as a pass over that sequence alone does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.head import DraftHead


@dataclass(frozen=True)
class Sequence:
    """Where a training sequence (prompt + the target's own answer) is; its ids and taps are read per step."""
    length: int  # rows: prompt + answer
    answer_start: int  # first generated row == first anchor position
    sample: int  # which sequence of its source (the training sample online, the prepared entry offline)


@dataclass
class Batch:
    """Padded sequences and their anchors: ids [b, R], taps [b, R, F], anchors [b, A] with `used` [b, A]
    marking real anchors (a sequence with fewer answer rows gets fewer), lengths [b]."""
    ids: torch.Tensor
    taps: torch.Tensor
    lengths: torch.Tensor
    anchors: torch.Tensor
    used: torch.Tensor


@dataclass
class StepStats:
    loss: torch.Tensor  # scalar, differentiable
    hits: torch.Tensor  # [B-1] top-1 hits per offset, over anchors whose offset lies inside the sequence
    counts: torch.Tensor  # [B-1] how many anchors each offset was scored on


def make_batch(ids: list[torch.Tensor], taps: list[torch.Tensor], anchors: list[list[int]]) -> Batch:
    """Pad sequences (ids with 0, taps with zeros: the masks hide both) and anchor lists to common sizes."""
    rows = max(i.shape[0] for i in ids)
    slots = max(len(a) for a in anchors)
    b = len(ids)
    padded_ids = torch.zeros(b, rows, dtype=torch.long)
    padded = taps[0].new_zeros(b, rows, taps[0].shape[-1])
    picks = torch.zeros(b, slots, dtype=torch.long)
    used = torch.zeros(b, slots, dtype=torch.bool)
    for i, (seq, tap, chosen) in enumerate(zip(ids, taps, anchors)):
        n = seq.shape[0]
        padded_ids[i, :n], padded[i, :n] = seq, tap
        picks[i, :len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        picks[i, len(chosen):] = chosen[0]  # a real row, so the unused slot's mask leaves context visible
        used[i, :len(chosen)] = True
    return Batch(padded_ids, padded, torch.tensor([i.shape[0] for i in ids]), picks, used)


def offset_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for offsets k = 1 .. B-1: near offsets matter most, as acceptance stops at a miss."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def batch_loss(head: DraftHead, embed, lm_head, batch: Batch, gamma: float) -> StepStats:
    """One forward over every anchor of every sequence in `batch` (on the head's device)."""
    cfg = head.config
    device = next(head.parameters()).device
    ids, taps = batch.ids.to(device), batch.taps.to(device, next(head.parameters()).dtype)
    anchors, used, lengths = batch.anchors.to(device), batch.used.to(device), batch.lengths.to(device)
    b, rows = ids.shape
    slots, block = anchors.shape[1], cfg.block_size
    offsets = torch.arange(block, device=device)
    ctx = head.context_kv(taps, torch.arange(rows, device=device)[None].expand(b, -1))

    positions = (anchors[:, :, None] + offsets).reshape(b, slots * block)  # [b, Q]
    block_ids = torch.full((b, slots, block), cfg.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    lowest = torch.finfo(torch.float32).min
    row_anchor = anchors.repeat_interleave(block, dim=1)  # [b, Q]: the anchor each query row belongs to
    hide_ctx = torch.arange(rows, device=device)[None, None] >= row_anchor[:, :, None]
    slot = torch.arange(slots, device=device).repeat_interleave(block)
    hide_block = (slot[:, None] != slot[None, :])[None].expand(b, -1, -1)
    ctx_mask = torch.zeros(b, 1, slots * block, rows, device=device).masked_fill(hide_ctx[:, None], lowest)
    block_mask = torch.zeros(b, 1, slots * block, slots * block, device=device).masked_fill(hide_block[:, None], lowest)
    with torch.no_grad():
        embeds = embed(block_ids.view(b, -1)).float()
    hidden = head(embeds, positions, ctx, ctx_mask, block_mask).view(b, slots, block, -1)
    logits = head.logits(hidden[:, :, 1:], lm_head).float()  # [b, A, B-1, V or the draft vocabulary]

    target = anchors[:, :, None] + offsets[1:]  # [b, A, B-1]
    valid = (target < lengths[:, None, None]) & used[:, :, None]
    labels = ids.gather(1, target.clamp(max=rows - 1).view(b, -1)).view_as(target)
    learnable = valid
    if cfg.draft_vocab_size:  # a token outside the draft vocabulary cannot be drafted: scored a miss, not learned
        lookup = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=device)
        lookup[head.draft_vocab_ids] = torch.arange(cfg.draft_vocab_size, device=device)
        labels = lookup[labels]
        learnable = valid & (labels >= 0)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.clamp(min=0).flatten(), reduction="none").view_as(target)
    w = offset_weights(block, gamma).to(device)[None, None] * learnable
    per_seq = (ce * w).sum((1, 2)) / w.sum((1, 2)).clamp(min=1e-6)
    with torch.no_grad():
        hits = ((logits.argmax(-1) == labels) & valid).sum((0, 1))
    return StepStats(per_seq.mean(), hits, valid.sum((0, 1)))
