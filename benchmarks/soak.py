"""Long runs: many consecutive prompts through one `Session` keep memory flat and every answer equal
to a fresh runner's (on the embedded default model unless told otherwise).

    python benchmarks/soak.py                                   # 1,000 prompts, each backend here
    python benchmarks/soak.py --backend onnxruntime --prompts 200 --json

Prompts cycle through the first `--distinct` held-out tasks of examples/*/tasks.jsonl. RSS is read at
the start (runner open, nothing decoded), after the first pass over the distinct prompts (every code
path and buffer warmed) and at the end; growth after that first pass is what a leak would show. The
fresh runners' answers are computed after the soak, so they never sit in the measured memory.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from glance_runtime.bench.task_prompts import BenchTask, read_bench_tasks
from glance_runtime.defaults import resolve
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.backends.registry import BACKENDS, Source, open_session
from glance_runtime.decode.session import Session

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KINDS = ("receipt", "chart", "scene", "caption")


def rss_mb() -> float:
    """Resident set size of this process now (Linux /proc), in MB."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def held_out(distinct: int) -> list[BenchTask]:
    """The first `distinct` tasks, taking the kinds in turn so every kind is in even a short run."""
    per_kind = [read_bench_tasks([EXAMPLES / kind / "tasks.jsonl"]) for kind in KINDS]
    mixed = [t for row in zip(*per_kind) for t in row]
    return mixed[:distinct]


def open_default(backend: str, threads: int | None = None) -> Session:
    model, head, artifacts, backend = resolve(None, None, None, backend)
    return open_session(Source(backend, model=model, head=head, artifacts=artifacts,
                               threads=threads if backend == "onnxruntime" else None))


def answer(session: Session, task: BenchTask, cfg: DecodeConfig) -> list[int]:
    return decode(session.backend, session.prompt(task.prompt, task.image), cfg, session.stop_ids).tokens


def soak(backend: str, prompts: int, distinct: int = 80, max_new_tokens: int = 32, threads: int | None = None,
         progress=lambda line: None) -> dict:
    """Run `prompts` prompts through one runner; report RSS and how many answers equal a fresh runner's."""
    tasks = held_out(distinct)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    gc.collect()
    runner = open_default(backend, threads)
    rss = {"start": rss_mb()}
    answers: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(prompts):
        answers.append(answer(runner, tasks[i % len(tasks)], cfg))
        if i + 1 == len(tasks):
            gc.collect()
            rss["after_first_pass"] = rss_mb()
        if (i + 1) % max(1, prompts // 10) == 0:
            progress(f"{backend}: {i + 1}/{prompts} prompts, RSS {rss_mb():.1f} MB")
    seconds = time.perf_counter() - t0
    gc.collect()
    rss["end"] = rss_mb()
    rss.setdefault("after_first_pass", rss["end"])
    del runner
    gc.collect()
    fresh = [answer(open_default(backend, threads), task, cfg) for task in tasks]
    identical = sum(a == fresh[i % len(tasks)] for i, a in enumerate(answers))
    return {"backend": backend, "prompts": prompts, "distinct": len(tasks), "max_new_tokens": max_new_tokens,
            "identical_to_fresh": identical, "rss_mb": {k: round(v, 1) for k, v in rss.items()},
            "growth_after_first_pass_mb": round(rss["end"] - rss["after_first_pass"], 1),
            "seconds": round(seconds, 1), "ms_per_prompt": round(seconds * 1e3 / prompts, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=(*BACKENDS, "all"), default="all",
                   help="all: torch and onnxruntime (the backends a CPU machine has)")
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=80, help="distinct held-out prompts cycled through")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: its own choice)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    backends = ("onnxruntime", "torch") if args.backend == "all" else (args.backend,)
    for backend in backends:
        report = soak(backend, args.prompts, args.distinct, args.max_new_tokens, args.threads, progress=print)
        if args.json:
            print(json.dumps(report))
        else:
            r = report["rss_mb"]
            print(f"{backend}: {report['identical_to_fresh']}/{report['prompts']} answers identical to a fresh "
                  f"runner's; RSS {r['start']} MB at start, {r['after_first_pass']} after the first "
                  f"{report['distinct']} prompts, {r['end']} at the end ({report['growth_after_first_pass_mb']:+} MB); "
                  f"{report['ms_per_prompt']} ms/prompt")


if __name__ == "__main__":
    main()
