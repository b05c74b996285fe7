"""The reduced draft vocabulary: the tokens a head drafts over when it need not score the whole vocabulary.

A head with one (config.json `draft_vocab_size: N`, an int64 tensor `draft_vocab_ids` of N ascending target
ids beside its weights) computes logits only for those rows of the target's LM head, which makes its draft
pass cheaper on large vocabularies; the tokens are the ones the target itself answers with most often.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from glance_export.model.vocab_choice import filled


def frequent_tokens(answers: Iterable[torch.Tensor], n: int, vocab_size: int) -> torch.Tensor:
    """The `n` ids most frequent in `answers` (ties to the lower id), ascending; where the answers use fewer
    distinct tokens, the lowest unused ids fill the rest, so the size is always `n`."""
    counts: Counter[int] = Counter()
    for answer in answers:
        counts.update(answer.tolist())
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]
    return torch.from_numpy(filled(chosen, n, vocab_size))
