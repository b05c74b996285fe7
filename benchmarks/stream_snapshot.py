"""Write a random snapshot of real width and any depth as real ones are laid out: bf16, sharded
(`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`), one shard in memory at a time.

The tokenizer and chat template are the tests' small ones (spare embedding rows past them, as in real
checkpoints); config.json is the tiny model's with the width and depth given here. Weights are normal
with std 1/sqrt(hidden) (norm weights 1), so activations stay finite at full depth in fp16.

    python benchmarks/stream_snapshot.py OUT --family qwen2 --layers 4 [--hidden 2048 --intermediate 11008
        --heads 16 --kv-heads 2 --vocab 151936 --tied --shard-gb 1]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]


def write_snapshot(out: Path, family: str, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                   vocab: int, tied: bool, shard_bytes: int) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from glance_export.model.meta_init import parameters_on_meta
    from support import make_snapshot

    snap = make_snapshot(out, family, layers=1, tied=tied)
    for old in snap.glob("*.safetensors"):
        old.unlink()
    raw = json.loads((snap / "config.json").read_text())
    raw.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tied,
               dtype="bfloat16", max_window_layers=layers)
    raw.pop("layer_types", None)
    (snap / "config.json").write_text(json.dumps(raw, indent=2))
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(snap), dtype=torch.bfloat16)
    params = list(model.named_parameters())
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    for name, p in params:
        if size and size + p.numel() * 2 > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, p.shape))
        size += p.numel() * 2
    torch.manual_seed(0)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: (torch.randn(shape, dtype=torch.bfloat16) * hidden ** -0.5 if len(shape) > 1
                          else torch.ones(shape, dtype=torch.bfloat16)) for name, shape in shard}
        save_file(tensors, str(snap / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        del tensors
    total = sum(p.numel() * 2 for _, p in params)
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return snap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", default="qwen2", choices=["qwen2", "qwen3", "llama"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--shard-gb", type=float, default=1.0)
    args = parser.parse_args()
    snap = write_snapshot(args.out, args.family, args.layers, args.hidden, args.intermediate, args.heads,
                          args.kv_heads, args.vocab, args.tied, int(args.shard_gb * 1e9))
    print(snap)


if __name__ == "__main__":
    main()
