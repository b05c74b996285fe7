"""EAGLE-3's training-time test: the head unrolled over its own guesses, as it drafts a chain at inference.

Stream row i holds (embedding of token i + 1, fc over the target's taps of row i) at position i; its output
predicts token i + 2. Step j >= 1 feeds row i the embedding of token i + 1 + j beside the step j - 1 pre-norm
output of the same row, at position i + j, and predicts token i + 2 + j: the state a drafted node at depth j
sees, whose hidden input is its parent's output, not the target's. Step j attends to the step-0 keys of rows
<= i (the committed rows) and to its own row's keys of steps 1..j (its ancestors and itself), nothing else.

The loss is each step's cross-entropy against the target's own next tokens, mapped into the draft vocabulary
(a token outside it is scored a miss, never learnt), weighted decay^j, on rows whose label lies in the answer
after the first generated token (the rows a round drafts); each sequence's weighted mean, averaged over
sequences, as for GLANCE heads (head_loss.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.eagle3 import Eagle3Head, rows_mask
from .head_loss import StepStats


@dataclass
class Eagle3Batch:
    """Padded sequences: ids [b, R] (0 past a sequence's end), taps [b, R, 3 x width], lengths [b] and the
    first generated row of each, answer_starts [b]."""
    ids: torch.Tensor
    taps: torch.Tensor
    lengths: torch.Tensor
    answer_starts: torch.Tensor


def make_eagle3_batch(ids: list[torch.Tensor], taps: list[torch.Tensor], answer_starts: list[int]) -> Eagle3Batch:
    """Pad sequences to the longest (ids with 0, taps with zeros: causal attention and the labels' mask hide
    both from every real row)."""
    rows = max(i.shape[0] for i in ids)
    padded_ids = torch.zeros(len(ids), rows, dtype=torch.long)
    padded = taps[0].new_zeros(len(ids), rows, taps[0].shape[-1])
    for n, (seq, tap) in enumerate(zip(ids, taps)):
        padded_ids[n, :seq.shape[0]], padded[n, :seq.shape[0]] = seq, tap
    return Eagle3Batch(padded_ids, padded, torch.tensor([i.shape[0] for i in ids]),
                       torch.tensor(answer_starts, dtype=torch.long))


def ttt_visibility(rows: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean [rows, rows * (step + 1)] over the keys of steps 0..step laid side by side: causal over step 0,
    the diagonal of every later step."""
    causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(rows, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def draft_lookup(head: Eagle3Head, device: torch.device) -> torch.Tensor | None:
    """target id -> draft id (-1 outside the draft vocabulary); None when the head drafts the whole vocabulary."""
    cfg = head.config
    if cfg.draft_vocab_size is None:
        return None
    drafted = torch.arange(cfg.draft_vocab_size, device=device)
    lookup = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=device)
    lookup[drafted + head.d2t.to(device)] = drafted
    return lookup


def ttt_logits(head: Eagle3Head, embed, ids: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft-vocabulary logits [b, R - 1, V'] of steps 0..steps-1; row i of step j predicts token i + 2 + j
    (rows whose input token lies past the sequence are padding the caller masks)."""
    b, total = ids.shape
    rows = total - 1
    device = ids.device
    row = torch.arange(rows, device=device)
    hidden = head.fuse(taps[:, :rows])
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    out = []
    for j in range(steps):
        with torch.no_grad():
            embeds = embed(ids[:, (row + 1 + j).clamp(max=total - 1)]).to(hidden.dtype)
        positions = (row + j)[None, None].expand(3, b, rows)
        mask = rows_mask(ttt_visibility(rows, j, device), hidden.dtype)
        normed, hidden, new = head(embeds, hidden, positions, past, mask)
        past = new if past is None else [(torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
                                         for (pk, pv), (k, v) in zip(past, new)]
        out.append(head.logits(normed))
    return out


def ttt_loss(head: Eagle3Head, embed, batch: Eagle3Batch, steps: int, decay: float) -> StepStats:
    """The decayed training-time-test loss of one batch, and each step's top-1 hits and scored rows."""
    device = next(head.parameters()).device
    dtype = next(head.parameters()).dtype
    ids, taps = batch.ids.to(device), batch.taps.to(device, dtype)
    lengths, starts = batch.lengths.to(device)[:, None], batch.answer_starts.to(device)[:, None]
    total = ids.shape[1]
    row = torch.arange(total - 1, device=device)
    lookup = draft_lookup(head, device)
    weighted = torch.zeros(ids.shape[0], device=device)
    weights = torch.zeros(ids.shape[0], device=device)
    hits, counts = [], []
    for j, logits in enumerate(ttt_logits(head, embed, ids, taps, steps)):
        label_row = row + 2 + j
        valid = (label_row[None] < lengths) & (label_row[None] > starts)  # [b, rows]
        labels = ids[:, label_row.clamp(max=total - 1)]
        if lookup is not None:
            labels = lookup[labels]
        learnable = valid & (labels >= 0)
        logits = logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none").view_as(labels)
        w = learnable.float() * decay ** j
        weighted = weighted + (ce * w).sum(1)
        weights = weights + w.sum(1)
        with torch.no_grad():
            hits.append(((logits.argmax(-1) == labels) & valid).sum())
            counts.append(valid.sum())
    per_seq = weighted / weights.clamp(min=1e-6)
    return StepStats(per_seq.mean(), torch.stack(hits), torch.stack(counts))
