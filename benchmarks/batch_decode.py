"""In-flight batching measured in one process: N clients, each sending its next request when its last is answered.

For each concurrency, three ways to serve the same requests on ONNX Runtime (CPU, one thread):
- `glance`: batched GLANCE (`open_batch`: one draft pass and one verify pass a round for every sequence; the
  default model's rows use `--budget auto`, the wide model's a seeded confident chain at tau 4, see below);
- `plain`: batched plain decoding (budget 0: one verify pass of one row a sequence a round);
- `serial`: one request at a time (what `--max-batch 1` does), GLANCE on the single-sequence loop.
A waiting request joins the batch at a round boundary, one prefill per boundary while others decode (as
glance-serve's scheduler admits them). Per request: latency (arrival to last token), time to first token (arrival
to the prefill's token), tokens; per run: tokens per second over the wall time. Every answer is compared with the
same request decoded alone on a single-sequence backend (token for token).

Models: the shipped default (`--model default`, the example tasks with their images), and a random Qwen2 text
model at Qwen2.5-3B width (hidden 2048, MLP 11008, 16 heads, 2 KV heads, 151,936 tokens, tied) cut to 8 layers,
exported int4 (group 128, int8 activations) with a random block-8 head drafting over a 32,768-token vocabulary (`--model wide --wide DIR`, made by
`python benchmarks/batch_decode.py make-wide DIR`). A random head accepts nothing, so the wide model's GLANCE
rows seed the target's own continuation into the draft at depths 1..3 with confident log-probs (tau 4) and verify
a chain (budget 3, branch 1): the loop's cost at a known acceptance, as `glance-bench --seed-drafts` does.

    python benchmarks/batch_decode.py make-wide /tmp/wide
    python benchmarks/batch_decode.py run OUT --model default --concurrency 1,2,4,8,16 --requests 32
    python benchmarks/batch_decode.py run OUT --model wide --wide /tmp/wide --concurrency 1,2,4,8 --requests 16
    python benchmarks/batch_decode.py plot OUT
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "runtime"), str(ROOT), str(ROOT / "benchmarks")]

DEFAULT = ROOT / "models" / "glance-vl-tiny-onnx"
WIDE_PROMPTS = ("Describe the picture in detail, then list every object you can see and its colour.",
                "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
                "List ten fruits and their colours.")
SEED_DEPTH = 3  # seeded drafts accepted a round: tau 4
DRAFT_VOCAB = 32768  # the wide head drafts over the first 32,768 ids


def make_wide(out: Path) -> None:
    """The wide snapshot, a random head and their int4 artifacts (with batched graphs)."""
    import subprocess

    from int4_vs_genai import WIDTH
    from support import make_wide_snapshot

    snap = out / "snapshot"
    if not (snap / "config.json").exists():
        make_wide_snapshot(snap, "qwen2", {**WIDTH, "num_hidden_layers": 8}, tied=True)
    cli = [sys.executable, "-c", "import sys; from glance_export.cli import main; sys.exit(main(sys.argv[1:]))"]
    if not (out / "head" / "config.json").exists():  # a reduced draft vocabulary, as a real head of this width has
        import torch

        from glance_export.model.adapters import Snapshot
        from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head

        snapshot = Snapshot(snap)
        head = init_head(replace(head_config_for(snapshot, 1, 8, pick_mask_token(snapshot)),
                                 draft_vocab_size=DRAFT_VOCAB), seed=0)
        head.draft_vocab_ids.copy_(torch.arange(DRAFT_VOCAB))
        save_head(head, out / "head")
    if not (out / "int4" / "manifest.json").exists():
        subprocess.run([*cli, "onnx", "--model", str(snap), "--head", str(out / "head"), "--out", str(out / "int4"),
                        "--quantize", "int4", "--max-context", "512", "--max-tree", "16", "--max-batch", "16"],
                       check=True)


class Workload:
    """The requests (prompts and decode settings) and how each is answered alone."""

    def __init__(self, model: str, wide: Path | None, requests: int, max_new: int):
        from glance_runtime.backends.ort_backend import OrtBackend
        from glance_runtime.prompt.codec import exported_codec
        from glance_runtime.prompt.messages import user_turn

        self.model = model
        self.artifacts = DEFAULT if model == "default" else wide / "int4"
        self.single = OrtBackend(self.artifacts, threads=1)
        self.codec = exported_codec(self.single.manifest)
        if model == "default":
            from glance_runtime.formats.tasks import read
            tasks = [t for kind in ("receipt", "chart", "scene", "caption")
                     for t in read(ROOT / "examples" / kind / "tasks.jsonl")]
            turns = [user_turn(t.prompt, [str(t.image)]) for t in tasks]
        else:
            turns = [user_turn(p, []) for p in WIDE_PROMPTS]
        self.prompts = [self.codec.encode([turns[i % len(turns)]]) for i in range(requests)]
        self.stops = self.codec.stop_ids if model == "default" else ()
        self.max_new = max_new
        self.truth: dict[int, list[int]] = {}

    def config(self, mode: str, session=None):
        from glance_runtime.decode.loop import DecodeConfig

        if mode == "plain":
            return DecodeConfig(max_new_tokens=self.max_new, budget=0, speculative=False)
        if self.model == "wide":
            return DecodeConfig(max_new_tokens=self.max_new, budget=SEED_DEPTH, branch_k=1)
        return replace(session.config, max_new_tokens=self.max_new)

    def seeds(self, index: int) -> list[int]:
        """The continuation the wide model's drafts are seeded with: what a seeded chain decode commits (on int8
        activations a tree pass may round a near tie otherwise than a one-row pass), iterated to a fixed point."""
        from glance_runtime.bench.seeding import ConfidentSeeds
        from glance_runtime.decode.loop import DecodeConfig, decode

        key = index % len(WIDE_PROMPTS)
        if key not in self.truth:
            prompt = self.prompts[index]
            truth = decode(self.single, prompt, DecodeConfig(max_new_tokens=self.max_new, budget=0,
                                                             speculative=False)).tokens
            for _ in range(8):
                out = decode(ConfidentSeeds(self.single, truth + [0] * 8, prompt.length, "partial"), prompt,
                             self.config("glance")).tokens
                if out == truth[:len(out)]:
                    break
                truth = out
            self.truth[key] = truth
        return self.truth[key]


class SeededBatch:
    """The wide model's batched drafts with the seeded chain: each ask's real batched draft is run (its time paid),
    then its rows seeded as `ConfidentSeeds` seeds a single sequence's."""

    def __init__(self, rounds, workload: Workload):
        self.rounds, self.workload = rounds, workload
        self.owner: dict[int, int] = {}  # slot -> request index
        real = rounds.draft

        def draft(asks):
            from glance_runtime.bench.seeding import ConfidentSeeds

            out = []
            for (slot, anchor, k, depth), drafted in zip(asks, real(asks)):
                index = self.owner[slot]
                view = _Drafted(rounds.slots[slot], drafted)
                seeded = ConfidentSeeds(view, workload.seeds(index) + [0] * 8, workload.prompts[index].length,
                                        "partial")
                out.append(seeded.draft(anchor, k, depth))
            return out

        rounds.draft = draft


class _Drafted:
    """A slot's backend whose `draft` is the batched draft already run for it (what ConfidentSeeds wraps)."""

    def __init__(self, backend, drafted):
        self.backend, self.drafted = backend, drafted
        self.name, self.block_size, self.info = backend.name, backend.block_size, backend.info

    @property
    def start(self) -> int:
        return self.backend.start

    def draft(self, anchor, k, depth=None):
        return self.drafted


def _closed_loop(concurrency: int, count: int, join, step, busy) -> tuple[dict[int, float], float]:
    """Clients send requests 0..count-1 in turn; each client's next arrives when its last is answered. `join(i)`
    starts request i (its prefill), `step()` runs a round and returns the indices it finished, `busy()` says whether
    any request is decoding. Returns each request's arrival time and the run's start."""
    start = time.perf_counter()
    arrivals = {i: start for i in range(min(concurrency, count))}
    waiting = sorted(arrivals)
    following = min(concurrency, count)
    while waiting or busy():
        if waiting:  # one prefill a round boundary while others decode; all at once when none does
            for _ in range(1 if busy() else len(waiting)):
                join(waiting.pop(0))
        for _ in step():
            if following < count:
                arrivals[following] = time.perf_counter()
                waiting.append(following)
                following += 1
    return arrivals, start


def run_mode(workload: Workload, mode: str, concurrency: int, count: int) -> dict:
    from glance_runtime.backends.batch_rounds import open_batch
    from glance_runtime.backends.registry import Source, open_session
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.decode.batch_loop import Request
    from glance_runtime.decode.loop import decode

    done_at, first_at, tokens = {}, {}, {}
    if mode == "serial":
        session = open_session(Source("onnxruntime", artifacts=workload.artifacts, threads=1))
        cfg = workload.config("glance", session)
        queue: list[int] = []

        def join(i: int) -> None:
            queue.append(i)

        def step() -> list[int]:
            if not queue:
                return []
            i = queue.pop(0)
            prompt = workload.prompts[i]
            backend = session.backend
            if workload.model == "wide":
                backend = ConfidentSeeds(backend, workload.seeds(i) + [0] * 8, prompt.length, "partial")

            def seen(new, i=i):
                first_at.setdefault(i, time.perf_counter())

            tokens[i] = decode(backend, prompt, cfg, workload.stops, on_commit=seen).tokens
            done_at[i] = time.perf_counter()
            return [i]

        arrivals, start = _closed_loop(concurrency, count, join, step, lambda: bool(queue))
    else:
        session = open_session(Source("onnxruntime", artifacts=workload.artifacts, threads=1, max_batch=16))
        loop = open_batch(session)
        if mode == "plain":
            loop.policy = None
        seeded = SeededBatch(loop.rounds, workload) if workload.model == "wide" and mode == "glance" else None
        if seeded is not None:
            session.backend.keep_embeddings(sorted({t for i in range(len(WIDE_PROMPTS)) for t in workload.seeds(i)}))
        cfg = workload.config(mode, session)
        requests: dict[int, Request] = {}

        def join(i: int) -> None:
            def seen(new, i=i):
                first_at.setdefault(i, time.perf_counter())

            requests[i] = Request(workload.prompts[i], cfg, workload.stops, on_commit=seen)
            slot = loop.free_slots()[0]
            if seeded is not None:
                seeded.owner[slot] = i
            loop.join(requests[i], slot)
            if requests[i].done:
                done_at[i] = time.perf_counter()

        def step() -> list[int]:
            finished = loop.step()
            now = time.perf_counter()
            out = []
            for i, r in requests.items():
                if r.done and i not in done_at:
                    done_at[i] = now
                if r in finished:
                    out.append(i)
            return out

        arrivals, start = _closed_loop(concurrency, count, join, step, lambda: bool(loop.active))
        for i, r in requests.items():
            tokens[i] = r.result.tokens
    wall = max(done_at.values()) - start
    latency = [(done_at[i] - arrivals[i]) * 1e3 for i in range(count)]
    ttft = [(first_at[i] - arrivals[i]) * 1e3 for i in range(count)]
    session.backend.close()
    return {"mode": mode, "concurrency": concurrency, "requests": count, "tokens": sum(len(t) for t in tokens.values()),
            "tokens_per_s": round(sum(len(t) for t in tokens.values()) / wall, 1),
            "latency_ms_p50": round(statistics.median(latency), 2), "latency_ms_p99": round(_p99(latency), 2),
            "ttft_ms_p50": round(statistics.median(ttft), 2), "ttft_ms_p99": round(_p99(ttft), 2),
            "answers": {i: tokens[i] for i in range(count)}}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def alone(workload: Workload, mode: str, count: int) -> list[list[int]]:
    """Each request decoded alone on the single-sequence backend, as its mode decodes it."""
    from glance_runtime.backends.registry import Source, open_session
    from glance_runtime.bench.seeding import ConfidentSeeds
    from glance_runtime.decode.loop import decode

    session = open_session(Source("onnxruntime", artifacts=workload.artifacts, threads=1))
    cfg = workload.config("glance" if mode == "serial" else mode, session)
    out = []
    for i in range(count):
        prompt, backend = workload.prompts[i], session.backend
        if workload.model == "wide" and mode != "plain":
            backend = ConfidentSeeds(backend, workload.seeds(i) + [0] * 8, prompt.length, "partial")
        out.append(decode(backend, prompt, cfg, workload.stops).tokens)
    session.backend.close()
    return out


def run(out: Path, args: argparse.Namespace) -> None:
    import os

    workload = Workload(args.model, args.wide, args.requests, args.max_new_tokens)
    out.mkdir(parents=True, exist_ok=True)
    reference = {mode: alone(workload, mode, args.requests) for mode in ("glance", "plain")}
    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for mode in ("serial", "plain", "glance"):
            row = run_mode(workload, mode, concurrency, args.requests)
            want = reference["plain" if mode == "plain" else "glance"]
            row["same_as_alone"] = sum(row["answers"][i] == want[i] for i in range(args.requests))
            del row["answers"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"model": args.model, "threads": 1, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "load_before": os.getloadavg()[0], "rows": rows}
    (out / f"batch_decode_{args.model}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"batch_decode_{args.model}.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"# In-flight batching, {report['model']} model (ONNX Runtime CPU, 1 thread, "
             f"{report['requests']} requests)", "",
             "| clients | mode | tokens/s | latency p50 / p99 ms | TTFT p50 / p99 ms | same as alone |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['tokens_per_s']} | {r['latency_ms_p50']} / "
                     f"{r['latency_ms_p99']} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} | "
                     f"{r['same_as_alone']}/{r['requests']} |")
    return "\n".join(lines) + "\n"


def plot(out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for path in sorted(out.glob("batch_decode_*.json")):
        report = json.loads(path.read_text())
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("serial", "plain", "glance"):
            rows = [r for r in report["rows"] if r["mode"] == mode]
            ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{report['model']} model, ONNX Runtime CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("make-wide").add_argument("out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--model", choices=("default", "wide"), default="default")
    r.add_argument("--wide", type=Path)
    r.add_argument("--concurrency", default="1,2,4,8,16")
    r.add_argument("--requests", type=int, default=32)
    r.add_argument("--max-new-tokens", type=int, default=64)
    sub.add_parser("plot").add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "make-wide":
        make_wide(args.out)
    elif args.command == "run":
        run(args.out, args)
    else:
        plot(args.out)


if __name__ == "__main__":
    main()
