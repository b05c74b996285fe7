"""Host memory of a backend opened for N sequences: one set of weights whatever N, plus a KV pool for N.

For each N (`--batches`, 1, 8 and 16 by default) a fresh process opens `OrtBackend(artifacts, threads=1,
max_batch=N)` (ONNX Runtime CPU) and records its resident set (VmRSS) and peak (VmHWM, reset after the imports
through /proc/self/clear_refs) as growth over the process after its imports, the backend's `kv_bytes` (target and
head pools) and `weight_bytes`; then decodes N prompts together for `--new-tokens` tokens (`decode` alone at N 1,
the batch loop over `BatchRounds` above; GLANCE with the model's own head at `--budget`, 15 by default and at most
max_tree - 1, or plainly at 0) and records RSS and peak again. The pool is allocated zeroed, so its pages count
only once the decode writes them; the decode also holds what a pass of N sequences needs besides the pool (the
backend's per-pass buffers and ONNX Runtime's arena, e.g. the vocab projection's N x (budget + 1) rows of logits),
which the bound leaves out: the table's last column shows how far the RSS after the decode is from it.

The bound, per N and stage (after the load, after the decode, and the peak by then): process RSS at N <= RSS at 1
+ (KV bytes at N - KV bytes at 1) + 5% of RSS at 1. PASS/FAIL is printed per N.

Models: the shipped default (`--model default`, models/glance-vl-tiny-onnx) and the Qwen2.5-3B-width int4 model
cut to 8 layers (`--model wide --wide DIR`: DIR/int4-exact, made by `python benchmarks/batch_decode.py make-wide
DIR`, which exports it for 16 sequences).

    python benchmarks/batch_memory.py run benchmarks/results/batch_weights --model default
    python benchmarks/batch_memory.py run benchmarks/results/batch_weights --model wide --wide /tmp/wide-v4

Writes OUT/batch_memory-MODEL-bBUDGET.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lone_sequence import commit_of

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "models" / "glance-vl-tiny-onnx"
PROMPTS = ("Describe the picture in detail, then list every object you can see and its colour.",
           "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List ten fruits and their colours.")
SLACK = 0.05  # of RSS at N 1
MIB = float(1 << 20)


def status_kib(field: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}: this benchmark needs Linux")


def reset_peak() -> None:
    """VmHWM back to the current RSS, so a later peak is the load's and not the imports'."""
    Path("/proc/self/clear_refs").write_text("5")


def pool_bytes(backend) -> int:
    """KV pool bytes: the backend's own figure, else worked out from the manifest's layer shapes."""
    if hasattr(backend, "kv_bytes"):
        return int(backend.kv_bytes)
    import numpy as np

    m = backend.manifest
    rows = backend.max_batch * backend.max_context
    width = np.dtype(backend.float).itemsize
    return sum(2 * part.num_layers * rows * part.kv_heads * part.head_dim * width for part in (m.target, m.head))


def measure(args: argparse.Namespace) -> None:
    """One N in this process: load, then decode N prompts together."""
    import numpy  # noqa: F401  (imported before the baseline: every run pays it alike)
    import onnxruntime  # noqa: F401
    from glance_runtime.backends.batch_rounds import BatchRounds
    from glance_runtime.backends.ort_backend import OrtBackend
    from glance_runtime.decode.batch_loop import BatchLoop, Request
    from glance_runtime.decode.loop import DecodeConfig, decode
    from glance_runtime.prompt.codec import exported_codec

    reset_peak()
    base = status_kib("VmRSS")
    started = time.perf_counter()
    backend = OrtBackend(args.artifacts, threads=1, max_batch=args.batch)
    load_s = round(time.perf_counter() - started, 2)
    budget = min(args.budget, backend.max_tree - 1)
    row = {"batch": args.batch, "budget": budget, "load_s": load_s, "base_kib": base,
           "kv_bytes": pool_bytes(backend), "weight_bytes": int(getattr(backend, "weight_bytes", 0)),
           "load": {"rss_kib": status_kib("VmRSS"), "peak_kib": status_kib("VmHWM")}}
    codec = exported_codec(backend.manifest)
    prompts = [codec.turn(PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]
    cfg = DecodeConfig(max_new_tokens=args.new_tokens, budget=budget, speculative=budget > 0)
    if args.batch == 1:
        results = [decode(backend, prompts[0], cfg)]
    else:
        results = BatchLoop(BatchRounds(backend)).run([Request(p, cfg) for p in prompts])
    row["decode"] = {"rss_kib": status_kib("VmRSS"), "peak_kib": status_kib("VmHWM"),
                     "tokens": [len(r.tokens) for r in results]}
    args.out.write_text(json.dumps(row))


def verdicts(rows: list[dict]) -> None:
    """Each row's bound per stage against the N-1 row: RSS and peak at N <= at 1 + the pool's growth + 5% of 1."""
    one = next(r for r in rows if r["batch"] == 1)
    for row in rows:
        grown = row["kv_bytes"] - one["kv_bytes"]
        row["bound"] = {}
        for stage, key in (("load", "rss_kib"), ("decode", "rss_kib"), ("decode", "peak_kib")):
            at1 = one[stage][key] * 1024
            limit = at1 + grown + SLACK * at1
            row["bound"][f"{stage}_{key.removesuffix('_kib')}"] = {
                "bytes": row[stage][key] * 1024, "limit": int(limit), "pass": row[stage][key] * 1024 <= limit}
        row["pass"] = all(b["pass"] for b in row["bound"].values())


def markdown(report: dict) -> str:
    lines = [f"# Host memory by max_batch, {report['model']} model (ONNX Runtime CPU, 1 thread, "
             f"{report['commit']})", "",
             f"Artifacts: {report['artifacts']}; weights {report['rows'][0]['weight_bytes'] / MIB:.1f} MiB. Growth "
             f"is over the process after its imports; the bound: process RSS at N <= RSS at 1 + KV growth + 5% of "
             f"RSS at 1, after the load, after a {report['new_tokens']}-token decode of N prompts together (budget "
             f"{report['budget']}), and the peak by then.", "",
             "| N | KV pool MiB | load RSS growth MiB | load peak growth MiB | decode RSS growth MiB | "
             "decode peak growth MiB | process RSS after decode MiB | limit MiB | over the limit MiB | bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        grow = {f"{s}_{k}": (row[s][f"{k}_kib"] - row["base_kib"]) / 1024 for s in ("load", "decode")
                for k in ("rss", "peak")}
        bound = row["bound"]["decode_rss"]
        over = (bound["bytes"] - bound["limit"]) / MIB
        lines.append(f"| {row['batch']} | {row['kv_bytes'] / MIB:.1f} | {grow['load_rss']:.1f} | "
                     f"{grow['load_peak']:.1f} | {grow['decode_rss']:.1f} | {grow['decode_peak']:.1f} | "
                     f"{bound['bytes'] / MIB:.1f} | {bound['limit'] / MIB:.1f} | {over:.1f} | "
                     f"{'PASS' if row['pass'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> None:
    artifacts = DEFAULT if args.model == "default" else args.wide / "int4-exact"
    args.out.mkdir(parents=True, exist_ok=True)
    env_path = [str(ROOT), str(ROOT / "runtime")]
    rows = []
    for batch in args.batches:
        result = args.out / f".batch_memory-{args.model}-{batch}.json"
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "measure", str(artifacts), str(batch),
                               str(result), "--new-tokens", str(args.new_tokens),
                               "--budget", str(args.budget)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(env_path)},
                              capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()
            raise SystemExit(f"max_batch {batch}: {tail[-1] if tail else done.returncode}")
        rows.append(json.loads(result.read_text()))
        result.unlink()
    verdicts(rows)
    report = {"model": args.model, "artifacts": str(artifacts), "commit": commit_of(ROOT),
              "new_tokens": args.new_tokens, "budget": rows[0]["budget"], "rows": rows}
    stem = args.out / f"batch_memory-{args.model}-b{report['budget']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    for row in rows:
        print(f"N={row['batch']}: {'PASS' if row['pass'] else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="every N in its own process, then the report")
    r.add_argument("out", type=Path)
    r.add_argument("--model", choices=("default", "wide"), default="default")
    r.add_argument("--wide", type=Path, default=Path("/tmp/wide-v4"), help="make-wide's DIR")
    r.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 16])
    r.add_argument("--new-tokens", type=int, default=8)
    r.add_argument("--budget", type=int, default=15, help="GLANCE's tree budget in the decode; 0: plain decoding")
    m = sub.add_parser("measure", help="one N (run's child)")
    m.add_argument("artifacts", type=Path)
    m.add_argument("batch", type=int)
    m.add_argument("out", type=Path)
    m.add_argument("--new-tokens", type=int, default=8)
    m.add_argument("--budget", type=int, default=15)
    args = ap.parse_args()
    if args.command == "run" and 1 not in args.batches:
        ap.error("--batches must include 1: the bound is against N 1")
    (run if args.command == "run" else measure)(args)


if __name__ == "__main__":
    main()
