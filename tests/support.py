"""Tiny random HF snapshots of every supported family, written as a user's snapshot would be.

Weights are re-drawn from a wide normal so that greedy output depends on the image and the
context with margins far above fp32 noise (transformers' default init collapses to one token).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from glance_export.train.tokenizer import CHAT_TEMPLATE  # the Qwen-style template of the default model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TEXT_FAMILIES = ("qwen2", "qwen3", "llama")
ALL_FAMILIES = VL_FAMILIES + TEXT_FAMILIES
CORPUS = ["What colour is the square? The square is red, green or blue.",
          "Describe the image. How many circles are there? Read the total on the receipt: 42.17",
          "user assistant system The quick brown fox jumps over the lazy dog 0123456789"]


def _tokenizer(out: Path) -> dict[str, int]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    ids["vocab"] = tok.get_vocab_size()
    return ids


def _config(family: str, ids: dict[str, int], layers: int, tied: bool = False):
    import transformers as tf

    vocab = ids["vocab"] + 8  # spare embedding rows past the tokenizer, like real checkpoints
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                tie_word_embeddings=tied, eos_token_id=ids["<|im_end|>"], rms_norm_eps=1e-6,
                bos_token_id=None, pad_token_id=ids["<|endoftext|>"])
    vl_ids = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  eos_token_id=ids["<|im_end|>"], tie_word_embeddings=tied)
    if family == "qwen2_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, **vl_ids)
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **vl_ids)
    if family == "qwen3_vl":
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                  "mrope_interleaved": True, "rope_theta": 10000.0})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **vl_ids)
    cls = {"qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "llama": tf.LlamaConfig}[family]
    if family == "qwen3":
        text["head_dim"] = 16
    return cls(**text)


def _processor(family: str) -> dict:
    patch = 16 if family == "qwen3_vl" else 14
    unit = patch * 2
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "temporal_patch_size": 2,
            "merge_size": 2, "min_pixels": unit * unit * 4, "max_pixels": unit * unit * 64,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


def make_snapshot(out: Path, family: str, layers: int = 4, seed: int = 0, std: float = 0.5,
                  tied: bool = False) -> Path:
    """Write a complete HF-format snapshot directory for a tiny random model of `family`; `tied` shares
    the embedding with the LM head, as Qwen2.5-VL-3B and Qwen3-VL-2B/4B do."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging

    logging.disable_progress_bar()  # the snapshot is tiny; progress lines would only pollute captured stderr
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out)
    config = _config(family, ids, layers, tied)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family in VL_FAMILIES else AutoModelForCausalLM
    model = auto.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
    model.save_pretrained(out)
    if family in VL_FAMILIES:
        (out / "preprocessor_config.json").write_text(json.dumps(_processor(family), indent=2))
    return out


def make_wide_snapshot(out: Path, family: str, text: dict, vision: dict | None = None, tied: bool = False) -> Path:
    """A random VL snapshot at another width: `text` and `vision` override the tiny config (nested dicts such
    as rope_parameters are merged), the tokenizer and processor stay the tiny model's, and weights are
    re-drawn at std 2/sqrt(hidden) so greedy output still depends on the context. For benchmarks at a
    real model's width; depth is text's num_hidden_layers."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    snap = make_snapshot(out, family, layers=text.get("num_hidden_layers", 4), tied=tied)
    raw = json.loads((snap / "config.json").read_text())
    for section, overrides in (("text_config", text), ("vision_config",
                                                       {"out_hidden_size": text["hidden_size"], **(vision or {})})):
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(raw[section].get(key), dict):
                raw[section][key].update(value)
            else:
                raw[section][key] = value
    raw["text_config"]["tie_word_embeddings"] = raw["tie_word_embeddings"] = tied
    (snap / "config.json").write_text(json.dumps(raw, indent=2))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(snap))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 2.0 / text["hidden_size"] ** 0.5)
    for old in snap.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(snap)
    return snap


def make_mid_snapshot(out: Path, layers: int) -> tuple[Path, int]:
    """A qwen3 text model at hidden 1024, intermediate 4096 (about 60 MB of fp32 weights a layer), for tests
    of memory that must not grow with depth; returns it and its fp32 weight bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    snap = make_snapshot(out, "qwen3", layers=layers)
    raw = json.loads((snap / "config.json").read_text())
    raw.update(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    raw.pop("layer_types", None)
    (snap / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(snap))
    (snap / "model.safetensors").unlink()
    model.save_pretrained(snap)
    return snap, sum(p.numel() * 4 for p in model.parameters())


def make_image(path: Path, width: int, height: int, seed: int) -> Path:
    """A seeded image of random coloured rectangles, so different seeds give different pictures."""
    rng = np.random.default_rng(seed)
    arr = np.zeros((height, width, 3), np.uint8) + rng.integers(0, 255, 3, dtype=np.uint8)
    for _ in range(6):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        arr[y0:y0 + height // 3, x0:x0 + width // 3] = rng.integers(0, 255, 3, dtype=np.uint8)
    Image.fromarray(arr).save(path)
    return Path(path)
