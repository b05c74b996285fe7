"""A two-step training run writes a complete, loadable snapshot that `evaluate` can score."""
from __future__ import annotations

import json

from glance_export.train import corpus
from glance_export.train.target import evaluate, train_target


def test_tiny_run_writes_a_loadable_snapshot(tmp_path):
    out = train_target(tmp_path / "m", steps=2, batch_size=2, vision_warmup=1, log_every=1, eval_every=0,
                       hidden=48, layers=1, vision_hidden=32, vision_depth=1)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "generation_config.json"} <= names
    gen = json.loads((out / "generation_config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    im_end = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    assert gen["eos_token_id"] == im_end
    assert "<|MASK|>" in {t["content"] for t in tok["added_tokens"]}
    task = corpus.write_task_file(tmp_path / "scene", "scene", 2)
    result = evaluate(out, task)
    assert result["scene"]["n"] == 2 and 0.0 <= result["scene"]["exact"] <= 1.0
