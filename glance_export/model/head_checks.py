"""What a head's config.json and its draft vocabulary must hold, checked once where a head is read (head.py;
eagle3.py shares the attention, number, rope and size checks).

A head directory is often edited by hand or copied from elsewhere. A size that is not a positive integer, a tap
outside the target, or a draft vocabulary whose ids repeat or leave the target's vocabulary does not fail where
it is read: it surfaces later as a traceback in the torch backend or the ONNX export, or as a graph that
exports and then breaks decoding mid-answer. Here it is one line naming the file, the key and the fix.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from glance_runtime.defaults import BRANCH_K
from glance_runtime.errors import GlanceError
from glance_runtime.formats.draft_ids import ids_problem

SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "num_target_layers")
RESTORE = "restore the head's config.json (or retrain the head)"
# rope types the heads' rotary classes (transformers') implement, and the fields each cannot do without
ROPE_FIELDS = {"default": (), "mrope": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "longrope": ("short_factor", "long_factor")}


def positive_number(value: Any) -> bool:
    """A finite JSON number above zero (a boolean is not one)."""
    return type(value) in (int, float) and math.isfinite(value) and value > 0


def check_attention(hidden: Any, heads: Any, kv_heads: Any, where: str, fix: str) -> None:
    """Heads split the width evenly and share key/value heads evenly (sizes already positive integers)."""
    if hidden % heads:
        raise GlanceError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; {fix}")
    if heads % kv_heads:
        raise GlanceError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                          f"{kv_heads}; {fix}")


def check_numbers(rope_theta: Any, eps: Any, where: str, fix: str) -> None:
    """rope_theta a positive number (zero or a string ends in NaN angles or a traceback), rms_norm_eps small and
    positive."""
    if not positive_number(rope_theta):
        raise GlanceError(f"{where}: rope_theta is {rope_theta!r}, not a positive number (such as 10000.0); {fix}")
    if not positive_number(eps) or eps >= 1:
        raise GlanceError(f"{where}: rms_norm_eps is {eps!r}, not a small positive number (such as 1e-6); {fix}")


def check_rope(rope: dict[str, Any], key: str, head_dim: int, where: str, fix: str) -> None:
    """A rope settings object (`key`: the field it came from): a known rope_type with the fields it needs, and an
    M-RoPE section of three non-negative integers splitting head_dim / 2."""
    kind = rope.get("rope_type")
    if kind not in ROPE_FIELDS:
        raise GlanceError(f"{where}: {key}.rope_type is {kind!r}, not one of {', '.join(ROPE_FIELDS)}; {fix}")
    for name in ROPE_FIELDS[kind]:
        if name not in rope:
            raise GlanceError(f"{where}: {key} of rope_type {kind!r} lacks {name!r}; {fix}")
        value = rope[name]
        values = value if kind == "longrope" and isinstance(value, list) else [value]  # per-frequency lists
        if not values or not all(positive_number(v) for v in values):
            raise GlanceError(f"{where}: {key}.{name} is {value!r}, not a positive number; {fix}")
    section = rope.get("mrope_section")
    if section is not None and (not isinstance(section, list) or len(section) != 3
                                or not all(type(s) is int and s >= 0 for s in section)
                                or sum(section) * 2 != head_dim):
        raise GlanceError(f"{where}: {key}.mrope_section is {section!r}, not three non-negative integers summing to "
                          f"head_dim / 2 ({head_dim // 2}); {fix}")
    if type(rope.get("mrope_interleaved", False)) is not bool:
        raise GlanceError(f"{where}: {key}.mrope_interleaved is {rope['mrope_interleaved']!r}, not true or false; {fix}")


def check_config(cfg: Any, where: str) -> None:
    """A HeadConfig's sizes are positive integers, its taps inside the target, its mask token and draft
    vocabulary inside its vocabulary."""
    for key in SIZES:
        value = getattr(cfg, key)
        if type(value) is not int or value < 1:
            raise GlanceError(f"{where}: {key} is {value!r}, not a positive integer; {RESTORE}")
    check_attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, where, RESTORE)
    check_numbers(cfg.rope_theta, cfg.rms_norm_eps, where, RESTORE)
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


def check_sizes(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], layers: int, weights: Path,
                config: Path, fix: str, spelled: Callable[[str], str] = str) -> None:
    """The config's sizes against the weights' shapes before a module is built from them: a size typed as a
    trillion, or a million layers, would otherwise be allocated (or built) before any shape is compared.
    `expected`: the shapes of a few tensors the config fixes (one absent is the missing-key check's to name);
    `spelled`: a key as the file spells it."""
    found = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()})
    if found != list(range(layers)):
        raise GlanceError(f"{weights} holds {len(found)} layer{'s' if len(found) != 1 else ''} but {config} has "
                          f"num_hidden_layers {layers}; {fix}")
    for key, shape in expected.items():
        if key in state and tuple(state[key].shape) != shape:
            raise GlanceError(f"{weights}: {spelled(key)} has shape {tuple(state[key].shape)}, but {config} makes it "
                              f"{shape}; {fix}")
