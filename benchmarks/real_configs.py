"""Random-weight snapshots of real Qwen-VL models at full (or cut) depth, laid out as published ones are:
bf16, sharded (`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`), config, tokenizer,
chat template and preprocessor files.

The configurations were typed from the models' published config.json files (no download is possible
here). The tokenizer and the special token ids are the tests' small ones (tests/support.py), so the
embedding has the real vocabulary's rows but only a few hundred are ever looked up. Weights are written
tensor by tensor from the model's meta-device skeleton (names and shapes from transformers, in the
checkpoint naming transformers saves), so a 8B snapshot is written in well under 1 GiB of memory.

    python benchmarks/real_configs.py OUT --model qwen2.5-vl-3b [--layers 4] [--vision-depth 2] [--shard-gib 2]
"""
from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

QWEN2_ROPE = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0}
QWEN3_ROPE = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True,
              "rope_theta": 5000000.0}
QWEN25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                     fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")

# From each model's published config.json (typed, not downloaded).
PUBLISHED = {
    "qwen2-vl-2b": {
        "family": "qwen2_vl",
        "text": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, hidden_act="silu", rope_parameters=QWEN2_ROPE),
        "vision": dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu"),
    },
    "qwen2.5-vl-3b": {
        "family": "qwen2_5_vl",
        "text": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, hidden_act="silu", rope_parameters=QWEN2_ROPE),
        "vision": dict(QWEN25_VISION, out_hidden_size=2048),
    },
    "qwen2.5-vl-7b": {
        "family": "qwen2_5_vl",
        "text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, hidden_act="silu", rope_parameters=QWEN2_ROPE),
        "vision": dict(QWEN25_VISION, out_hidden_size=3584),
    },
    "qwen3-vl-2b": {
        "family": "qwen3_vl",
        "text": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", rope_parameters=QWEN3_ROPE),
        "vision": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
    },
    "qwen3-vl-8b": {
        "family": "qwen3_vl",
        "text": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", rope_parameters=QWEN3_ROPE),
        "vision": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
    },
}
CHUNK = 1 << 26  # elements written at a time (128 MB of bf16)
POOL = 1 << 25


def cut(name: str, layers: int | None, vision_depth: int | None) -> tuple[dict, dict]:
    """The published text and vision configs, depth cut where asked; layer-index lists mapped proportionally."""
    published = PUBLISHED[name]
    text, vision = dict(published["text"]), dict(published["vision"])
    if layers is not None:
        text["num_hidden_layers"] = layers
    if vision_depth is not None:
        full = vision["depth"]
        vision["depth"] = vision_depth
        for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if key in vision:
                vision[key] = sorted({min(vision_depth - 1, i * vision_depth // full) for i in vision[key]})
    return text, vision


def _config_json(snap: Path, text: dict, vision: dict) -> dict:
    """The tiny snapshot's config (its token ids) with the published text and vision sections merged in."""
    raw = json.loads((snap / "config.json").read_text())
    for section, overrides in (("text_config", text), ("vision_config", vision)):
        for key, value in overrides.items():
            raw[section][key] = dict(value) if isinstance(value, dict) else value
    raw["text_config"].pop("layer_types", None)  # one per layer: transformers derives it again for this depth
    raw["tie_word_embeddings"] = raw["text_config"]["tie_word_embeddings"]
    raw["dtype"] = raw["text_config"]["dtype"] = "bfloat16"
    return raw


def checkpoint_tensors(snap: Path) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor the snapshot's config has, from a meta-device model."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(snap), dtype=torch.bfloat16)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, state).items()}


def _pool(std: float):
    """bf16 bits of 2^25 normal draws at `std`: every matrix is cut from it at a random offset, which is
    random enough for timing and memory and costs a copy instead of a draw per weight."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randn(POOL, generator=gen).mul_(std).to(torch.bfloat16).view(torch.int16).numpy()


def _values(name: str, shape: tuple[int, ...], pool, seed: int):
    """The tensor's bf16 bytes in chunks: the normal pool for matrices, ones for norms, zeros for biases."""
    import numpy as np

    total = math.prod(shape)
    rng = np.random.default_rng(seed)
    one = np.array(0x3F80, np.uint16).view(np.int16)  # bf16 1.0
    for start in range(0, total, CHUNK):
        n = min(CHUNK, total - start)
        if len(shape) >= 2:
            offset = int(rng.integers(POOL))
            chunk = np.resize(np.concatenate([pool[offset:], pool[:offset]]), n)
        else:
            chunk = np.full(n, one if ("norm" in name or ".ln_" in name) else 0, np.int16)
        yield chunk.tobytes()


def _shards(tensors: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(path: Path, names: list[str], tensors: dict[str, tuple[int, ...]], pool,
                 seeds: dict[str, int]) -> None:
    """One safetensors file, header first, then each tensor streamed in chunks."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = 2 * math.prod(tensors[name])
        header[name] = {"dtype": "BF16", "shape": list(tensors[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        for name in names:
            for piece in _values(name, tensors[name], pool, seeds[name]):
                fh.write(piece)
    tmp.rename(path)


def skeleton(out: Path, name: str, layers: int | None = None, vision_depth: int | None = None) -> Path:
    """The snapshot's files other than its weights: config, tokenizer, chat template, preprocessor."""
    from support import make_snapshot

    text, vision = cut(name, layers, vision_depth)
    snap = make_snapshot(out, PUBLISHED[name]["family"], layers=1, tied=text["tie_word_embeddings"])
    for old in snap.glob("*.safetensors"):
        old.unlink()
    (snap / "config.json").write_text(json.dumps(_config_json(snap, text, vision), indent=2) + "\n")
    return snap


def write_snapshot(out: Path, name: str, layers: int | None = None, vision_depth: int | None = None,
                   shard_gib: float = 2.0, progress=print) -> Path:
    """Write the random snapshot of `name` (depth cut where asked) to `out`; returns `out`."""
    text, _ = cut(name, layers, vision_depth)
    snap = skeleton(out, name, layers, vision_depth)
    tensors = checkpoint_tensors(snap)
    seeds = {k: i for i, k in enumerate(sorted(tensors))}
    shards = _shards(tensors, int(shard_gib * (1 << 30)))
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    pool = _pool(2.0 / text["hidden_size"] ** 0.5)
    t0 = time.perf_counter()
    for k, (file, names) in enumerate(zip(files, shards)):
        _write_shard(snap / file, names, tensors, pool, seeds)
        progress(f"[{name}] wrote {file} ({len(names)} tensors) in {time.perf_counter() - t0:.0f}s")
    total = sum(2 * math.prod(s) for s in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return snap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=sorted(PUBLISHED), required=True)
    parser.add_argument("--layers", type=int, help="text layers (default: the published depth)")
    parser.add_argument("--vision-depth", type=int, help="vision blocks (default: the published depth)")
    parser.add_argument("--shard-gib", type=float, default=2.0)
    args = parser.parse_args()
    write_snapshot(args.out, args.model, args.layers, args.vision_depth, args.shard_gib)


if __name__ == "__main__":
    main()
