"""What a head's config.json and its draft vocabulary must hold, checked once where a head is read (head.py).

A head directory is often edited by hand or copied from elsewhere. A size that is not a positive integer, a tap
outside the target, or a draft vocabulary whose ids repeat or leave the target's vocabulary does not fail where
it is read: it surfaces later as a traceback in the torch backend or the ONNX export, or as a graph that
exports and then breaks decoding mid-answer. Here it is one line naming the file, the key and the fix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from glance_runtime.defaults import BRANCH_K
from glance_runtime.errors import GlanceError
from glance_runtime.formats.draft_ids import ids_problem

SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "num_target_layers")
RESTORE = "restore the head's config.json (or retrain the head)"


def check_config(cfg: Any, where: str) -> None:
    """A HeadConfig's sizes are positive integers, its taps inside the target, its mask token and draft
    vocabulary inside its vocabulary."""
    for key in SIZES:
        value = getattr(cfg, key)
        if type(value) is not int or value < 1:
            raise GlanceError(f"{where}: {key} is {value!r}, not a positive integer; {RESTORE}")
    if type(cfg.block_size) is not int or cfg.block_size < 2:
        raise GlanceError(f"{where}: block_size is {cfg.block_size!r}, not an integer >= 2; {RESTORE}")
    taps = cfg.target_layer_ids
    if not taps or not all(type(t) is int and 0 <= t < cfg.num_target_layers for t in taps):
        raise GlanceError(f"{where}: dflash_config.target_layer_ids is {taps!r}, not layers of the target's "
                          f"0..{cfg.num_target_layers - 1} (num_target_layers); {RESTORE}")
    if type(cfg.mask_token_id) is not int or not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise GlanceError(f"{where}: dflash_config.mask_token_id is {cfg.mask_token_id!r}, not a token id below "
                          f"vocab_size {cfg.vocab_size}; {RESTORE}")
    n = cfg.draft_vocab_size
    if n is not None and (type(n) is not int or not BRANCH_K <= n <= cfg.vocab_size):
        raise GlanceError(f"{where}: draft_vocab_size is {n!r}, not an integer from {BRANCH_K} (the top-k a draft "
                          f"offset branches into) up to vocab_size {cfg.vocab_size}; set it to the length of the "
                          "head's draft_vocab_ids, or retrain the head with --draft-vocab")


def check_draft_ids(ids: torch.Tensor | None, cfg: Any, weights: Path, config: Path) -> None:
    """The head's `draft_vocab_ids` (when its config has a draft vocabulary): draft_vocab_size distinct int64 ids
    of the target's vocabulary (`ids_problem`, the rule the runtime applies to an exported graph)."""
    if not cfg.draft_vocab_size or ids is None:
        return  # a missing tensor is the weights' mismatch with the config, refused as such
    if ids.dtype != torch.int64:
        problem = f"holds {str(ids.dtype).removeprefix('torch.')} values, not int64 token ids"
    else:
        problem = ids_problem(ids.numpy(), cfg.draft_vocab_size, cfg.vocab_size)
    if problem is not None:
        raise GlanceError(f"{weights}: draft_vocab_ids {problem} ({config} has draft_vocab_size "
                          f"{cfg.draft_vocab_size}); restore the head's files, or retrain it with --draft-vocab")
