"""Which target tokens a head drafts over when the export chooses (a head trained without a draft vocabulary).

Scoring a large vocabulary is most of a shallow draft's cost on a CPU: the LM head is read whole for every
projection. A head with a draft vocabulary of N tokens scores only those rows; verification still scores every
token, so the answer cannot change, only how often a draft is accepted. Where no training data chose the tokens,
the target's own tokenizer ranks them: a byte-level BPE learns its merges most frequent pair first on the target's
training text, so a token's merge rank orders it by how often that text used it. Every token the tokenizer adds
beside its merges (end of turn, stop and tool tokens) is kept, whatever its rank.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Iterable

import numpy as np

from glance_runtime.defaults import BRANCH_K
from glance_runtime.errors import GlanceError

if TYPE_CHECKING:  # torch is imported where a head is restricted: the CLI reads the constants without it
    from glance_export.model.eagle3 import Eagle3Head
    from glance_export.model.head import DraftHead

AUTO, ALL = "auto", "all"  # --draft-vocab: the export's choice (the default), or every token
LARGE_VOCAB = 65536  # a target vocabulary above this gets a reduced draft vocabulary by default
DEFAULT_SIZE = 32768  # its size: about a fifth of Qwen's 151,936 tokens


def default_size(vocab_size: int) -> int | None:
    """The draft vocabulary an export gives a head without one: DEFAULT_SIZE tokens above LARGE_VOCAB, else none."""
    return DEFAULT_SIZE if vocab_size > LARGE_VOCAB else None


def check_size(n: int | None, vocab_size: int) -> None:
    """A draft offset branches into BRANCH_K tokens, so a smaller draft vocabulary could not be decoded with."""
    if n is not None and not BRANCH_K <= n <= vocab_size:
        raise GlanceError(f"--draft-vocab {n}: pass {BRANCH_K} (the top-k a draft offset branches into) up to the "
                          f"target's vocabulary of {vocab_size} tokens")


def merge_ranks(tokenizer: dict) -> tuple[dict[int, int], list[int]]:
    """Each token's rank in a BPE tokenizer (tokenizer.json's document): a merged token's merge index, the base
    alphabet before every merge (by id); and the ids of tokens added beside the merges."""
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise GlanceError("the target's tokenizer is not a BPE tokenizer, so its merges cannot rank its tokens; "
                          "pass --draft-vocab all to draft over every token")
    vocab, merges = model["vocab"], model.get("merges") or []
    made: dict[int, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        token = vocab.get(left + right)
        if token is not None and token not in made:
            made[token] = rank
    alphabet = sorted(token for token in vocab.values() if token not in made)
    ranks = {token: i - len(alphabet) for i, token in enumerate(alphabet)}  # before every merge
    ranks.update(made)
    added = sorted(int(entry["id"]) for entry in tokenizer.get("added_tokens") or [] if "id" in entry)
    return ranks, added


def frequent_ids(tokenizer: dict, vocab_size: int, size: int, keep: Iterable[int] = ()) -> np.ndarray:
    """`size` ascending target ids: `keep` and the tokenizer's added tokens, then its tokens by merge rank, then the
    lowest ids left (ids past the tokenizer's vocabulary, which it never produces, come last)."""
    ranks, added = merge_ranks(tokenizer)
    chosen = list(dict.fromkeys(t for t in [*keep, *added] if 0 <= t < vocab_size))[:size]
    taken = set(chosen)
    ranked = sorted((rank, token) for token, rank in ranks.items() if token not in taken and 0 <= token < vocab_size)
    return filled(chosen + [token for _, token in ranked[:size - len(chosen)]], size, vocab_size)


def filled(chosen: list[int], size: int, vocab_size: int) -> np.ndarray:
    """`chosen` (distinct ids) and then the lowest ids not in it, `size` in all, ascending: a draft vocabulary is
    always its stated size, however few tokens the statistics behind it name."""
    taken = set(chosen)
    rest = (token for token in range(vocab_size) if token not in taken)
    return np.array(sorted(chosen + [next(rest) for _ in range(size - len(chosen))]), dtype=np.int64)


def head_for_export(snapshot, head: DraftHead | Eagle3Head, asked: int | str) -> tuple[DraftHead | Eagle3Head, str | None]:
    """The head the export writes graphs for (`asked`: AUTO, ALL or a size), and a line saying which tokens it drafts
    over where the export chose them (None: the head as it is)."""
    import torch

    from glance_export.model.eagle3 import Eagle3Head
    from glance_export.model.head import with_draft_vocab

    if isinstance(head, Eagle3Head):
        if asked != AUTO:
            raise GlanceError(f"--draft-vocab {asked} is for GLANCE heads; an EAGLE-3 head drafts over the vocabulary "
                              "it was trained with: drop --draft-vocab")
        return head, None
    vocab, own = head.config.vocab_size, head.config.draft_vocab_size
    if own:
        if asked not in (AUTO, own):
            raise GlanceError(f"the head drafts over its own {own} tokens, chosen when it was trained; drop "
                              f"--draft-vocab {asked} (or train a head with --draft-vocab {asked})")
        return head, None
    size = default_size(vocab) if asked == AUTO else None if asked == ALL else int(asked)
    if size is None or size >= vocab:
        return head, None
    check_size(size, vocab)
    tokenizer = json.loads(snapshot.tokenizer.backend_tokenizer.to_str())
    ids = frequent_ids(tokenizer, vocab, size, snapshot.stop_token_ids)
    return with_draft_vocab(head, torch.from_numpy(ids)), (
        f"the head drafts over {size:,} of the target's {vocab:,} tokens (its tokenizer's added tokens, then its "
        f"tokens in merge order: the most frequent first); `glance-export audit` reports how many of the answers' "
        f"tokens they hold, and --draft-vocab all scores every token")
