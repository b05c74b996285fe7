"""Peak memory of offline head training is bounded by a shard and a batch, not by the data set's size.

A random qwen3 text target at hidden 1024 (one layer by default) answers long prompts; `prepare-head-data` writes its taps
and `train-head --prepared` trains from them, each in its own process so its max RSS is its own, for two data
set sizes (4x apart). The prepared bytes grow with the data; the peaks should not.

    python benchmarks/train_memory.py OUT [--sizes 20,80] [--prompt-words 100] [--shard-mb 4] [--steps 10]
        [--layers 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT)]

from support import CORPUS, make_mid_snapshot  # noqa: E402


def peak_mib(argv: list[str]) -> float:
    """Run glance-export in a child process; its max RSS in MiB (refuses a failed run)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "runtime")]))
    child = subprocess.Popen([sys.executable, "-m", "glance_export", *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        raise SystemExit(f"glance-export {' '.join(argv)} failed:\n{out}")
    return usage.ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", default="20,80", help="data set sizes (samples)")
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--shard-mb", type=float, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=1, help="target layers")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, _ = make_mid_snapshot(args.out / "target", layers=args.layers)
    words = " ".join(CORPUS).split()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        tasks = args.out / f"tasks_{n}.jsonl"
        tasks.write_text("".join(json.dumps({"prompt": " ".join(words[(i + j) % len(words)]
                                                                 for j in range(args.prompt_words))}) + "\n"
                                 for i in range(n)))
        prepared = args.out / f"prepared_{n}"
        prep = peak_mib(["prepare-head-data", "--model", str(model), "--data", str(tasks), "--out", str(prepared),
                         "--max-new-tokens", "16", "--shard-mb", str(args.shard_mb), "--threads", "2"])
        size = sum(p.stat().st_size for p in prepared.iterdir()) / 2**20
        train = peak_mib(["train-head", "--model", str(model), "--prepared", str(prepared), "--out",
                          str(args.out / f"head_{n}"), "--steps", str(args.steps), "--batch", "4", "--anchors", "8",
                          "--block-size", "8", "--threads", "2"])
        rows.append((n, size, prep, train))
        print(f"{n} samples: prepared {size:.0f} MiB; peak RSS prepare {prep:.0f} MiB, train --prepared "
              f"{train:.0f} MiB", flush=True)
    print("\n| samples | prepared MiB | prepare peak MiB | train --prepared peak MiB |\n|---|---|---|---|")
    for n, size, prep, train in rows:
        print(f"| {n} | {size:.0f} | {prep:.0f} | {train:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
