"""Head training end to end at a real model's width: a random Qwen2.5-VL with the published Qwen2.5-VL-3B
widths (depth cut, as benchmarks/real_width.py builds it) goes through prepare-head-data, a few train-head
steps from the prepared data under torchrun (gloo, 2 processes), the ONNX export of target and trained head,
and the audit of ONNX Runtime against the torch greedy oracle, which must be identical on every prompt.

Each stage runs in its own process; the table gives its time and peak memory (max RSS, for torchrun the
largest of its children).

    python benchmarks/train_real_width.py OUT [--layers 2] [--vision-depth 2] [--n 3] [--steps 3]
        [--max-new-tokens 12]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

from real_width import PUBLISHED, TASKS, cut  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "runtime")]))


def stage(name: str, argv: list[str], rows: list[dict]) -> str:
    """Run one stage; record its wall time and the peak RSS of the processes it started."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    rows.append({"stage": name, "s": round(time.perf_counter() - t0, 1), "peak_children_gib": round(peak, 2)})
    print(f"{name}: {rows[-1]['s']}s, largest child so far {peak:.2f} GiB", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vision-depth", type=int, default=2)
    ap.add_argument("--n", type=int, default=3, help="prompts (from examples/receipt)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    from support import make_wide_snapshot

    text, vision = cut(PUBLISHED["qwen2.5-vl-3b"], args.layers, args.vision_depth)
    t0 = time.perf_counter()
    snap = make_wide_snapshot(out / "snapshot", "qwen2_5_vl", text, vision, tied=True)
    rows.append({"stage": "random snapshot", "s": round(time.perf_counter() - t0, 1)})
    tasks = out / "tasks.jsonl"
    lines = TASKS.read_text().splitlines()[:args.n]
    tasks.write_text("".join(json.dumps({**json.loads(line), "image": str(TASKS.parent / json.loads(line)["image"])})
                             + "\n" for line in lines))
    glance = [sys.executable, "-m", "glance_export"]
    new = ["--max-new-tokens", str(args.max_new_tokens)]
    stage("prepare-head-data", [*glance, "prepare-head-data", "--model", str(snap), "--data", str(tasks),
                                "--out", str(out / "prepared"), *new, "--threads", "1"], rows)
    log = stage("train-head --prepared, torchrun 2 processes",
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                 "glance_export", "train-head", "--model", str(snap), "--prepared", str(out / "prepared"),
                 "--out", str(out / "head"), "--steps", str(args.steps), "--batch", "1", "--anchors", "4",
                 "--log-every", "1", "--threads", "1"], rows)
    print("\n".join(line for line in log.splitlines() if line.startswith("step ")), flush=True)
    stage("onnx export", [*glance, "onnx", "--model", str(snap), "--head", str(out / "head"), "--out",
                          str(out / "artifacts"), "--max-tree", "64", "--max-context", "512", "--quiet"], rows)
    report = json.loads(stage("audit onnxruntime vs torch oracle",
                              [*glance, "audit", "--data", str(tasks), "--model", str(snap), "--head", str(out / "head"),
                               "--artifacts", str(out / "artifacts"), "--backend", "onnxruntime", *new, "--json",
                               "--threads", "2"], rows))
    print(f"\naudit: {report['identical']}/{report['n']} identical to greedy, tau {report['tau']}")
    print("\n| stage | seconds | largest child so far (GiB) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['s']} | {r.get('peak_children_gib', '')} |")
    (out / "train_real_width.json").write_text(json.dumps({"stages": rows, "audit": {
        k: report[k] for k in ("n", "identical", "tau", "passed")}}, indent=2))
    return 0 if report["identical"] == report["n"] else 1


if __name__ == "__main__":
    sys.exit(main())
