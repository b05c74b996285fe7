"""fp32 vs int8 vs int4 weight-only graphs on ONNX Runtime CPU: AR and GLANCE ms/token, graph bytes, peak
memory; on the embedded default also held-out exact match per kind and drift from fp32.

    python benchmarks/quantize_bench.py OUT [--threads 2] [--layers 2] [--skip-real] [--skip-default]

Real width: a random Qwen2.5-VL with Qwen2.5-VL-3B's text width (hidden 2048, 16 heads, 2 KV heads,
intermediate 11008, the real 151,936-row vocabulary, tied as in the 3B) cut to --layers layers, a tiny
vision tower, and an untrained 1-layer head (it accepts almost nothing: GLANCE ms/token there is the
cost of a round at tau ~1, not a speedup claim). Each scheme is measured in its own process (peak RSS
is that process's VmHWM: session load + decoding). ms/token excludes prefill, median over samples after a
dropped warm-up, AR and GLANCE interleaved.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

SCHEMES = ("fp32", "int8", "int4")
REAL_PROMPTS = ["Describe the picture in detail.", "What is the total on the receipt?", "Count the circles."]


def make_real_width(out: Path, layers: int, vocab: int) -> Path:
    """A random Qwen2.5-VL snapshot at Qwen2.5-VL-3B's text width, tied, with the tiny test vision tower."""
    from support import make_wide_snapshot

    text = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                vocab_size=vocab, num_hidden_layers=layers, rope_parameters={"mrope_section": [16, 24, 24]})
    return make_wide_snapshot(out, "qwen2_5_vl", text, tied=True)


def export_all(model: Path, head: Path, out: Path, group: int) -> dict[str, Path]:
    from glance_export.onnx import export_artifacts

    arts = {}
    for scheme in SCHEMES:
        arts[scheme] = out / scheme
        if not (arts[scheme] / "manifest.json").is_file():
            export_artifacts(model, head, arts[scheme], max_tree=32, max_context=512, group_size=group,
                             quantize=None if scheme == "fp32" else scheme, progress=lambda line: print(" ", line))
    return arts


def graph_bytes(artifacts: Path) -> dict[str, int]:
    """ONNX Runtime files per graph (graph + external data) and the TensorRT form's total."""
    manifest = json.loads((artifacts / "manifest.json").read_text())
    sizes = {name: sum((artifacts / f).stat().st_size for f in (e["file"], e.get("data_file")) if f)
             for name, e in manifest["graphs"].items()}
    q = manifest.get("quantization") or {}
    sizes["tensorrt_form"] = sum((artifacts / f).stat().st_size for e in q.get("graphs", {}).values()
                                 for f in (e["tensorrt_file"], e["tensorrt_data_file"]) if f)
    return sizes


def _exact(runner, tokens: list[int], answers: list[str]) -> bool:
    return runner.detokenize(tokens).strip() in answers


def _peak_rss_mb() -> float:
    """This process's resident high-water mark (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM in /proc/self/status")


def measure(artifacts: Path, tasks: Path | None, threads: int, samples: int, max_new: int, budget: int) -> dict:
    """Runs in a child process: one session, interleaved AR/GLANCE samples per prompt, accuracy, peak RSS."""
    from glance_runtime.decode.loop import DecodeConfig, decode
    from glance_runtime.backends.registry import open_runner

    runner = open_runner("onnxruntime", artifacts=artifacts, threads=threads)
    if tasks is None:
        rows = [{"prompt": p, "image": None} for p in REAL_PROMPTS]
    else:
        rows = [json.loads(line) for line in Path(tasks).read_text().splitlines() if line.strip()]
        rows = [dict(r, image=Path(tasks).parent / r["image"] if r.get("image") else None) for r in rows]
    ar_cfg = DecodeConfig(max_new_tokens=max_new, speculative=False)
    spec_cfg = DecodeConfig(max_new_tokens=max_new, budget=budget, branch_k=8)
    ar_ms, spec_ms, accepted, rounds, outputs, correct = [], [], 0, 0, [], {}
    for i, row in enumerate(rows):
        prompt = runner.build_prompt(row["prompt"], row["image"])
        truth = decode(runner.backend, prompt, ar_cfg, runner.stop_ids).tokens
        outputs.append(truth)
        if "answers" in row:
            kind = correct.setdefault(row.get("kind", "all"), [0, 0])
            kind[0] += _exact(runner, truth, row["answers"] or [row["answer"]])
            kind[1] += 1
        if i >= samples:
            continue
        for j in range(3):  # the first pair is a warm-up
            order = [(ar_cfg, ar_ms), (spec_cfg, spec_ms)]
            for cfg, sink in order if j % 2 == 0 else order[::-1]:
                result = decode(runner.backend, prompt, cfg, runner.stop_ids)
                if result.tokens != truth:
                    raise SystemExit(f"{artifacts}: GLANCE diverged from AR on {row['prompt']!r}")
                if j:
                    sink.append(result.ms_per_token_decode)
                    if cfg.speculative:
                        accepted += sum(r.accepted for r in result.rounds)
                        rounds += len(result.rounds)
    return {"ar_ms_per_token": statistics.median(ar_ms), "glance_ms_per_token": statistics.median(spec_ms),
            "tau": accepted / rounds, "peak_rss_mb": _peak_rss_mb(),
            "exact": {k: v[0] / v[1] for k, v in correct.items()}, "n_per_kind": {k: v[1] for k, v in correct.items()},
            "outputs": outputs}


def child(artifacts: Path, tasks: Path | None, args) -> dict:
    cmd = [sys.executable, __file__, "--measure", str(artifacts), "--threads", str(args.threads),
           "--samples", str(args.samples), "--max-new", str(args.max_new), "--budget", str(args.budget)]
    if tasks is not None:
        cmd += ["--tasks", str(tasks)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def drift(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    from glance_export.audit.drift import compare

    rows = [compare(a, b) for a, b in zip(outputs, reference)]
    ref = sum(r["reference_tokens"] for r in rows)
    return {"identical": sum(r["identical"] for r in rows), "n": len(rows),
            "prefix_agreement": sum(r["prefix_tokens"] for r in rows) / ref if ref else 1.0,
            "first_divergence": [r["first_divergence"] for r in rows]}


def run_case(name: str, arts: dict[str, Path], tasks: Path | None, args, schemes=SCHEMES) -> list[dict]:
    rows = []
    for scheme in schemes:
        print(f"measuring {name} {scheme}", flush=True)
        m = child(arts[scheme], tasks, args)
        b = graph_bytes(arts[scheme])
        rows.append({"case": name, "scheme": scheme, **{k: v for k, v in m.items() if k != "outputs"}, "bytes": b,
                     "decode_bytes": b["target"] + b["draft"] + b["vocab"], "outputs": m["outputs"]})
    reference = rows[0]["outputs"]
    for row in rows:
        row["drift"] = drift(row.pop("outputs"), reference)
    return rows


def table(rows: list[dict]) -> str:
    base = {r["case"]: r for r in rows if r["scheme"] == "fp32"}
    lines = ["| case | scheme | target+draft+vocab MB (x fp32) | vision MB | AR ms/tok (x fp32 speed) | "
             "GLANCE ms/tok | tau | peak RSS MB | greedy = fp32 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = base[r["case"]]
        lines.append(f"| {r['case']} | {r['scheme']} | {r['decode_bytes'] / 1e6:.1f} ({r['decode_bytes'] / f['decode_bytes']:.2f}x)"
                     f" | {r['bytes'].get('vision', 0) / 1e6:.1f} | {r['ar_ms_per_token']:.2f} "
                     f"({f['ar_ms_per_token'] / r['ar_ms_per_token']:.2f}x) | {r['glance_ms_per_token']:.2f} | "
                     f"{r['tau']:.2f} | {r['peak_rss_mb']:.0f} | {r['drift']['identical']}/{r['drift']['n']} prompts, "
                     f"{r['drift']['prefix_agreement']:.0%} tokens |")
    return "\n".join(lines)


def accuracy_table(rows: list[dict]) -> str:
    kinds = sorted({k for r in rows for k in r["exact"]})
    lines = ["| scheme | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for r in rows:
        lines.append(f"| {r['scheme']} | " + " | ".join(f"{r['exact'][k]:.0%} of {r['n_per_kind'][k]}" for k in kinds) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--group-size", type=int, default=128, help="real width (the default model uses 32)")
    ap.add_argument("--samples", type=int, default=3, help="prompts timed per scheme")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--real-schemes", nargs="*", default=["int8", "int4"], choices=("int8", "int4"),
                    help="quantized schemes measured at real width (int8 runs ~100x slower than int4 there)")
    ap.add_argument("--skip-default", action="store_true")
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tasks", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.tasks, args.threads, args.samples, args.max_new, args.budget)))
        return
    from glance_export.model.adapters import Snapshot
    from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
    from glance_runtime.defaults import default_model

    rows = []
    if not args.skip_default:
        model, head = default_model()
        arts = export_all(model, head, args.out / "default", 32)
        tasks = args.out / "default" / "heldout.jsonl"
        lines = []
        for kind_file in sorted((ROOT / "examples").glob("*/tasks.jsonl")):
            for line in kind_file.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    row["image"] = str(kind_file.parent / row["image"]) if row.get("image") else None
                    lines.append(json.dumps(row))
        tasks.write_text("\n".join(lines) + "\n")
        default_rows = run_case("default (group 32)", arts, tasks, args)
        rows += default_rows
        print(accuracy_table(default_rows), flush=True)
    if not args.skip_real:
        root = args.out / "real"
        snap = root / "snapshot"
        if not (snap / "config.json").is_file():
            make_real_width(snap, args.layers, args.vocab)
        head = root / "head"
        if not (head / "config.json").is_file():
            s = Snapshot(snap)
            save_head(init_head(head_config_for(s, 1, 16, pick_mask_token(s)), seed=0), head)
        arts = export_all(snap, head, root, args.group_size)
        rows += run_case(f"3B width, {args.layers} layers (group {args.group_size})", arts, None, args,
                         ("fp32", *args.real_schemes))
    print(table(rows))
    if not args.skip_default:
        print(accuracy_table([r for r in rows if r["case"].startswith("default")]))
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
