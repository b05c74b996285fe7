"""Bytes on disk of every exported graph against the weights they come from, and the loop's time per round.

Random Qwen2.5-VL targets with the real Qwen vocabulary (151,936 rows), tied and untied, so the
embedding and LM head dominate as they do in a 2-3B model. The goal: summed graph bytes at most
1.05x the target's safetensors plus the head's own weights (no weight stored twice).

    python benchmarks/graph_bytes.py OUT [--hidden 512 --layers 4 --vocab 151936 --rounds 40]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]


def make_target(out: Path, hidden: int, layers: int, vocab: int, tied: bool) -> Path:
    """A random Qwen2.5-VL snapshot of the given width and vocabulary, its own tokenizer and processor."""
    from support import make_wide_snapshot

    heads = hidden // 64
    text = dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 4), vocab_size=vocab, num_hidden_layers=layers,
                rope_parameters={"mrope_section": [8, 12, 12]})
    return make_wide_snapshot(out, "qwen2_5_vl", text, tied=tied)


def graph_bytes(artifacts: Path) -> dict[str, int]:
    manifest = json.loads((artifacts / "manifest.json").read_text())
    sizes = {}
    for name, entry in manifest["graphs"].items():
        files = [entry["file"]] + ([entry["data_file"]] if entry.get("data_file") else [])
        sizes[name] = sum((artifacts / f).stat().st_size for f in files)
    return sizes


def time_rounds(artifacts: Path, rounds: int, threads: int) -> dict[str, float]:
    """ms per round of GLANCE (budget 15) and ms per token of AR on ONNX Runtime CPU, prefill excluded."""
    from glance_runtime.backends.ort_backend import OrtBackend
    from glance_runtime.decode.loop import DecodeConfig, decode

    backend = OrtBackend(artifacts, threads=threads)
    prompt = backend.build_prompt("Describe the image. How many circles are there?", None)
    out = {}
    for mode, cfg in (("glance_ms_per_round", DecodeConfig(max_new_tokens=rounds, budget=15)),
                      ("ar_ms_per_token", DecodeConfig(max_new_tokens=rounds, speculative=False))):
        decode(backend, prompt, DecodeConfig(max_new_tokens=4, budget=15))  # warm-up
        result = decode(backend, prompt, cfg)
        out[mode] = round(sum(r.total_ms for r in result.rounds) / len(result.rounds), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
    from glance_export.onnx import export_artifacts

    report = {}
    for tied in (True, False):
        name = "tied" if tied else "untied"
        root = args.out / name
        print(f"[{name}] writing a random target (hidden {args.hidden}, vocab {args.vocab})", flush=True)
        snap = make_target(root / "snapshot", args.hidden, args.layers, args.vocab, tied)
        snapshot = Snapshot(snap)
        head_dir = save_head(init_head(head_config_for(snapshot, 1, 16, pick_mask_token(snapshot)), seed=0),
                             root / "head")
        t0 = time.perf_counter()
        artifacts = export_artifacts(snap, head_dir, root / "artifacts", max_tree=64, max_context=512,
                                     progress=lambda line: print(f"[{name}] {line}", flush=True))
        weights = sum(p.stat().st_size for p in snap.glob("*.safetensors"))
        head = (head_dir / "model.safetensors").stat().st_size
        graphs = graph_bytes(artifacts)
        report[name] = {"target_safetensors": weights, "head_safetensors": head, "graphs": graphs,
                        "graphs_total": sum(graphs.values()),
                        "ratio": round(sum(graphs.values()) / (weights + head), 3),
                        "export_s": round(time.perf_counter() - t0, 1),
                        **time_rounds(artifacts, args.rounds, args.threads)}
        print(json.dumps({name: report[name]}), flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
