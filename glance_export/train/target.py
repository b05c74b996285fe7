"""Train the project's tiny Qwen2.5-VL target from scratch on the synthetic corpus, and score it.

The model is a stock `Qwen2_5_VLForConditionalGeneration`, so every adapter, exporter and runtime
path in the toolkit treats it exactly like a downloaded Qwen checkpoint. Training data are drawn
by sample index from the run seed, so a resumed run sees the same stream as an uninterrupted one.

    glance-export train-target --out runs/target --threads 1               # warmup + 3600 steps
    glance-export train-target --out runs/target --steps 5600 --threads 1  # resume: +2000 steps

The second call resumes from `checkpoint.pt` with a longer cosine schedule (a warm restart at
~1.3e-4); charts need those 2000 steps. The peak learning rate of 5e-4 is what lets the language
model learn lookups among several scene shapes: at 1e-3 it stayed at chance on them.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from PIL import Image
from transformers import (AutoImageProcessor, AutoTokenizer, GenerationConfig, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration)

from glance_export.train import corpus
from glance_export.train.prompts import encode, image_processor_config
from glance_export.train.tokenizer import train_tokenizer
from glance_export.train.warmup import warmup_vision
from glance_runtime.prompt.images import load_image, to_rgb
from glance_runtime.store.atomic import atomic_files, output_directory

# Receipts are a fixed-place read, learnt first; charts and scenes need question-dependent lookups.
MIX = {"receipt": 0.1, "chart": 0.35, "scene": 0.45, "caption": 0.1}


def model_config(tokenizer, hidden: int = 192, layers: int = 4, vision_hidden: int = 128,
                 vision_depth: int = 4) -> Qwen2_5_VLConfig:
    """A few-M-parameter Qwen2.5-VL; the vision window covers the whole image (full attention)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|im_end|>", "<|endoftext|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
            "<|vision_end|>")}
    heads = 4
    third = hidden // heads // 2 // 3
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [hidden // heads // 2 - 2 * third, third, third]})
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
                  num_heads=4, out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=2 * corpus.IMAGE_SIZE,
                  fullatt_block_indexes=[vision_depth - 1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], eos_token_id=ids["<|im_end|>"],
                            pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)


def write_processing_files(out_dir: Path, seed: int) -> tuple:
    """Tokenizer, chat template and image-processor config: everything but the weights."""
    tokenizer = train_tokenizer(corpus.corpus_text(seed, 4000))
    with atomic_files(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
        (tmp / "preprocessor_config.json").write_text(json.dumps(image_processor_config(corpus.IMAGE_SIZE), indent=2))
    return AutoTokenizer.from_pretrained(out_dir), AutoImageProcessor.from_pretrained(out_dir)


def save_checkpoint(model, opt, step: int, path: Path) -> None:
    """Replaced by one rename: a run killed while saving still resumes from the previous checkpoint."""
    with atomic_files(path.parent) as tmp:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp / path.name)


def collate(items: list[dict], pad_id: int) -> dict:
    """Right-pad a list of `encode` outputs into one batch."""
    width = max(it["input_ids"].shape[1] for it in items)
    fills = {"input_ids": pad_id, "attention_mask": 0, "mm_token_type_ids": 0, "labels": -100}
    batch = {k: torch.full((len(items), width), v, dtype=items[0][k].dtype) for k, v in fills.items()}
    for i, it in enumerate(items):
        n = it["input_ids"].shape[1]
        for k in fills:
            batch[k][i, :n] = it[k][0]
    batch["pixel_values"] = torch.cat([it["pixel_values"] for it in items])
    batch["image_grid_thw"] = torch.cat([it["image_grid_thw"] for it in items])
    return batch


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


@torch.no_grad()
def greedy(model, tokenizer, image_processor, image: Image.Image, prompt: str, max_new: int = 24) -> str:
    """The target's greedy reply (the output speculative decoding must reproduce)."""
    inputs = encode(tokenizer, image_processor, image, prompt)
    model.model.rope_deltas = None  # cached per prompt by the model; stale across prompts
    out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def score(model, tokenizer, image_processor, rows: list[dict]) -> dict:
    """Exact match per kind, with the real image and with a blank one of the same size."""
    result: dict[str, dict] = {}
    for r in rows:
        image = to_rgb(r["image"]) if isinstance(r["image"], Image.Image) else load_image(r["image"])
        accepted = set(r.get("answers") or [r["answer"]])
        blank = Image.new("RGB", image.size, (255, 255, 255))
        m = result.setdefault(r["kind"], {"n": 0, "exact": 0, "exact_blank": 0})
        m["n"] += 1
        m["exact"] += greedy(model, tokenizer, image_processor, image, r["prompt"]) in accepted
        m["exact_blank"] += greedy(model, tokenizer, image_processor, blank, r["prompt"]) in accepted
    for m in result.values():
        m["exact"], m["exact_blank"] = m["exact"] / m["n"], m["exact_blank"] / m["n"]
    return result


def evaluate(snapshot_dir: Path, task_file: Path) -> dict:
    """Per-kind greedy exact match of a snapshot on a task JSONL, plus the blank-image control."""
    rows = corpus.read_task_file(task_file)  # refused before the model loads
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(snapshot_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(snapshot_dir)
    image_processor = AutoImageProcessor.from_pretrained(snapshot_dir)
    for r in rows:
        r.setdefault("kind", Path(task_file).parent.name)
    return score(model, tokenizer, image_processor, rows)


def _heldout_rows(n: int) -> list[dict]:
    return [{"kind": s.kind, "image": s.image, "prompt": s.prompt, "answers": list(s.answers)}
            for kind in corpus.KINDS for s in corpus.heldout(kind, n, seed=1)]


TARGET_RUN_FORMAT = "glance-target-run"  # checkpoints and the snapshot they become


def train_target(out_dir: Path, *, steps: int = 3600, seed: int = 0, time_budget_s: float = 2700.0,
                 batch_size: int = 16, lr: float = 5e-4, warmup: int = 200, log_every: int = 50,
                 ckpt_every: int = 500, eval_every: int = 1000, mix: dict[str, float] | None = None,
                 vision_warmup: int = 1200, **size) -> Path:
    """Train (or resume) a target in `out_dir` and write a complete HF snapshot there.

    A fresh run first spends `vision_warmup` steps teaching the vision tower digits (see `warmup`).
    Stops at `steps` or when `time_budget_s` runs out, whichever comes first; a checkpoint in
    `out_dir/checkpoint.pt` lets a later call with the same arguments continue the same run.
    """
    out_dir = output_directory(out_dir, TARGET_RUN_FORMAT, "glance-export train-target")
    torch.manual_seed(seed)
    tokenizer, image_processor = write_processing_files(out_dir, seed)
    config = model_config(tokenizer, **size)
    model = Qwen2_5_VLForConditionalGeneration(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    ckpt, step = out_dir / "checkpoint.pt", 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    else:
        warmup_vision(model, image_processor, steps=vision_warmup, seed=seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M  vocab {len(tokenizer)}", flush=True)
    rows = _heldout_rows(8) if eval_every else []
    start, smooth = time.time(), None
    model.train()
    while step < steps and time.time() - start < time_budget_s:
        samples = [corpus.training_sample(seed, step * batch_size + j, mix or MIX) for j in range(batch_size)]
        batch = collate([encode(tokenizer, image_processor, s.image, s.prompt, s.answer) for s in samples],
                        tokenizer.pad_token_id)
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup)
        model.model.rope_deltas = None
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if step % log_every == 0:
            print(f"step {step}/{steps} loss {smooth:.4f} lr {g['lr']:.2e} "
                  f"{time.time() - start:.0f}s", flush=True)
        if step % ckpt_every == 0 or step == steps:
            save_checkpoint(model, opt, step, ckpt)
        if eval_every and (step % eval_every == 0 or step == steps):
            model.eval()
            print(f"eval step {step}: {json.dumps(score(model, tokenizer, image_processor, rows))}", flush=True)
            model.train()
    save_checkpoint(model, opt, step, ckpt)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=None, do_sample=False, max_new_tokens=32)
    with atomic_files(out_dir) as tmp:
        model.save_pretrained(tmp)
    return out_dir
