"""The batched training step scores every sequence exactly as a pass over that sequence alone does."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from glance_export.model.head import HeadConfig, init_head
from glance_export.train.head_loss import batch_loss, make_batch

H, VOCAB, TAPS, BLOCK, GAMMA = 32, 50, 2, 6, 7.0


def reference_loss(head, embed, lm_head, ids, taps, anchors, gamma):
    """One sequence, its anchors as separate blocks over the whole context, rows at or after each anchor
    masked: the per-sequence loss the batch must reproduce."""
    cfg, rows, n = head.config, ids.shape[0], anchors.shape[0]
    ctx = head.context_kv(taps[None], torch.arange(rows)[None])
    ctx = [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in ctx]
    offsets = torch.arange(BLOCK)
    block = torch.full((n, BLOCK), cfg.mask_token_id)
    block[:, 0] = ids[anchors]
    positions = anchors[:, None] + offsets[None]
    hide = torch.arange(rows)[None, :] >= anchors[:, None]
    mask = torch.zeros(n, 1, BLOCK, rows).masked_fill(hide[:, None, None, :], torch.finfo(torch.float32).min)
    logits = lm_head(head(embed(block), positions, ctx, mask)[:, 1:])
    target = positions[:, 1:]
    valid = target < rows
    labels = torch.where(valid, ids[target.clamp(max=rows - 1)], -100)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="none").view(n, -1)
    w = torch.exp(-(offsets[1:].float() - 1) / gamma)[None] * valid
    return (ce * w).sum() / w.sum()


def _setup():
    torch.manual_seed(0)
    cfg = HeadConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=64, vocab_size=VOCAB, block_size=BLOCK, num_target_layers=4,
                     target_layer_ids=[1, 2], mask_token_id=VOCAB - 1)
    head = init_head(cfg, seed=0).train()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # away from init, so attention patterns matter
    embed, lm_head = torch.nn.Embedding(VOCAB, H), torch.nn.Linear(H, VOCAB, bias=False)
    rng = random.Random(1)
    ids, taps, anchors = [], [], []
    for rows, start, n in ((23, 9, 5), (12, 4, 8), (30, 20, 3)):  # lengths, answers and anchor counts differ
        ids.append(torch.randint(0, VOCAB - 1, (rows,)))
        taps.append(torch.randn(rows, TAPS * H))
        anchors.append(sorted(rng.sample(range(start, rows - 1), min(n, rows - 1 - start))))
    return head, embed, lm_head, ids, taps, anchors


def _grads(head):
    return torch.cat([p.grad.flatten() for p in head.parameters()])


def test_batch_loss_and_gradient_equal_the_per_sequence_mean():
    head, embed, lm_head, ids, taps, anchors = _setup()
    stats = batch_loss(head, embed, lm_head, make_batch(ids, taps, anchors), GAMMA)
    stats.loss.backward()
    batched = _grads(head)
    head.zero_grad()
    per_seq = [reference_loss(head, embed, lm_head, i, t, torch.tensor(a), GAMMA)
               for i, t, a in zip(ids, taps, anchors)]
    reference = torch.stack(per_seq).mean()
    reference.backward()
    assert abs(stats.loss.item() - reference.item()) < 1e-5 * reference.item()
    assert torch.allclose(batched, _grads(head), rtol=1e-4, atol=1e-6)
    # anchors near a sequence's end score fewer offsets: the counts say so
    assert stats.counts[0] == sum(len(a) for a in anchors) and stats.counts[-1] < stats.counts[0]

