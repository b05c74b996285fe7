"""Write a mid-size random Qwen2.5-VL snapshot, a matching random head, and their ONNX artifacts.

The test snapshots (hidden 64) run a graph pass in about a millisecond, so any fixed per-round
Python cost looks huge next to them; this model (default hidden 512, 8 layers, 32k vocabulary)
gives graph passes closer in proportion to a real target when measuring the loop's overhead.

    python benchmarks/make_bench_model.py OUT [--hidden 512 --layers 8 --vocab 32000 --block-size 16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", default="qwen2_5_vl")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=1024)
    args = ap.parse_args()

    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
    from glance_export.onnx import export_artifacts
    from support import make_wide_snapshot

    heads = args.hidden // 64
    text = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 4), vocab_size=args.vocab, num_hidden_layers=args.layers,
                rope_parameters={"mrope_section": [8, 12, 12]})  # halves of head_dim 64, in Qwen's 2:3:3 split
    snap_dir = make_wide_snapshot(args.out / "snapshot", args.family, text)
    snapshot = Snapshot(snap_dir)
    head = init_head(head_config_for(snapshot, 1, args.block_size, pick_mask_token(snapshot)), seed=0)
    head_dir = save_head(head, args.out / "head")
    export_artifacts(snap_dir, head_dir, args.out / "artifacts", max_tree=64, max_context=args.max_context)


if __name__ == "__main__":
    main()
