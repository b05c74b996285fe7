"""In-flight batching measured in one process: N clients, each sending its next request when its last is answered.

For each concurrency, three ways to serve the same requests on ONNX Runtime (CPU, one thread):
- `glance`: batched GLANCE (`open_batch`: one draft pass and one verify pass a round for every sequence; the
  default model's rows use `--budget auto`, the wide model's a seeded confident chain at tau 4, see below);
- `plain`: batched plain decoding (budget 0: one verify pass of one row a sequence a round);
- `serial`: one request at a time (what `--max-batch 1` does), GLANCE on the single-sequence loop.
A waiting request joins the batch at a round boundary, one prefill per boundary while others decode (as
glance-serve's scheduler admits them); every request prefills its whole prompt in every mode (no slot keeps rows
for the next request, which the serial line has no way to do either). Per request: latency (arrival to last
token), time to first token (the wait for a slot, or for the one decoder, plus the prefill), tokens; per run:
tokens per second over the wall time. Each default-model run first serves 8 requests a client untimed, so the
counted ones meet the model as a server's would (a fresh batch's auto spends its first windows looking at
drafting). Every answer is compared with the same request decoded alone on a single-sequence backend (token for
token).

Models: the shipped default (`--model default`, the example tasks with their images), and a random Qwen2 text
model at Qwen2.5-3B width (hidden 2048, MLP 11008, 16 heads, 2 KV heads, 151,936 tokens, tied) cut to 8 layers,
exported int4 (group 128) with a random block-8 head drafting over a 32,768-token vocabulary (`--model wide --wide DIR`, made by
`python benchmarks/batch_decode.py make-wide DIR`). A random head accepts nothing, so the wide model's GLANCE
rows seed the target's own continuation into the draft at depths 1..3 with confident log-probs (tau 4) and verify
a chain (budget 3, branch 1): the loop's cost at a known acceptance, as `glance-bench --seed-drafts` does.
Its int4 export multiplies with fp32 activations (`--accuracy exact`): with int8 activations (`--accuracy int8`)
a batched pass and a single one quantize activations that differ in their last bits (the batched attention adds
in another order), which on this model's near-flat random logits changes tokens, so neither every answer equals
the request alone nor do the seeds survive; with fp32 activations both passes agree to about 3e-5.

    python benchmarks/batch_decode.py make-wide /tmp/wide
    python benchmarks/batch_decode.py run OUT --model default --concurrency 1,2,4,8,16 --requests 32
    python benchmarks/batch_decode.py run OUT --model wide --wide /tmp/wide --concurrency 1,2,4,8 --requests 16
    python benchmarks/batch_decode.py plot OUT

`--repeats N` runs every concurrency's three modes N times, back to back each time, and reports each figure's
median (every run's tokens/s kept beside it) and each ratio as the median of the repeats' own: one run's
tokens/s swings by a tenth or more on a shared machine.
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
WIDE_FORM = "int4-exact"  # int4 weights, fp32 activations: see the docstring
WARM_EACH = 8  # requests a client serves untimed before the counted ones, default model: a fresh batch's auto
# looks at drafting in its first windows, which a served model pays once, not in every 64 requests


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
    if not (out / WIDE_FORM / "manifest.json").exists():
        subprocess.run([*cli, "onnx", "--model", str(snap), "--head", str(out / "head"), "--out", str(out / WIDE_FORM),
                        "--quantize", "int4", "--accuracy", "exact", "--max-context", "512", "--max-tree", "16",
                        "--max-batch", "16"], check=True)


class Workload:
    """The requests (prompts and decode settings) and how each is answered alone."""

    def __init__(self, model: str, wide: Path | None, requests: int, max_new: int):
        from glance_runtime.backends.ort_backend import OrtBackend
        from glance_runtime.prompt.codec import exported_codec
        from glance_runtime.prompt.messages import user_turn

        self.model = model
        self.artifacts = DEFAULT if model == "default" else wide / WIDE_FORM
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
        self.stops = self.codec.stop_ids
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


class Seeded:
    """The wide model's drafts with the seeded chain, in a batched model: each batched draft is run (its time paid),
    then each sequence's rows are seeded as `ConfidentSeeds` seeds one sequence's; a sequence alone in the batch
    is seeded the same way on its slot."""

    def __init__(self, model, workload: Workload):
        from glance_runtime.bench.seeding import ConfidentSeeds

        loop = model.scheduler.loop
        rounds = loop.rounds
        truths = {workload.prompts[i].input_ids.tobytes(): (workload.seeds(i) + [0] * 8, workload.prompts[i].length)
                  for i in range(min(len(WIDE_PROMPTS), len(workload.prompts)))}
        rounds.base.keep_embeddings(sorted({t for truth, _ in truths.values() for t in truth}))
        batched, alone = rounds.draft, rounds.alone

        def seeds(slot: int, backend) -> ConfidentSeeds:
            truth, length = truths[loop.active[slot].prompt.input_ids.tobytes()]
            return ConfidentSeeds(backend, truth, length, "partial")

        def draft(asks):
            return [seeds(slot, _Slot(rounds.slots[slot], drafted)).draft(anchor, k, depth)
                    for (slot, anchor, k, depth), drafted in zip(asks, batched(asks))]

        def alone_seeded(slot, anchor):
            backend = alone(slot, anchor)
            backend._kept = rounds.base._kept  # the seeded tokens' embeddings, kept once for every slot
            return seeds(slot, _Slot(backend))

        rounds.draft, rounds.alone = draft, alone_seeded


class _Slot:
    """A slot's backend as `ConfidentSeeds` wraps it, its draft the batched one already run where given; without
    `keep_embeddings`, which the seeding would call every round."""

    def __init__(self, backend, drafted=None):
        self.backend, self.drafted = backend, drafted
        self.name, self.block_size, self.info = backend.name, backend.block_size, backend.info

    @property
    def start(self) -> int:
        return self.backend.start

    def prefill(self, prompt, keep: int = 0):
        return self.backend.prefill(prompt, keep)

    def draft(self, anchor, k, depth=None):
        return self.drafted if self.drafted is not None else self.backend.draft(anchor, k, depth)

    def verify(self, tokens, depths, visible):
        return self.backend.verify(tokens, depths, visible)

    def commit(self, rows):
        self.backend.commit(rows)


def run_mode(workload: Workload, mode: str, concurrency: int, count: int) -> dict:
    """Clients on threads, each submitting its next request when its last is answered, through the public API:
    `serial` one request at a time (max_batch 1, the calls serialised), the others batched (max_batch 16)."""
    import threading

    import glance_runtime as gr
    from serve_load import pct

    wide = workload.model == "wide"
    budget = 0 if mode == "plain" else SEED_DEPTH if wide else None  # 0: plain steps (glance-serve's --budget 0)
    model = gr.load(workload.artifacts, threads=1, max_batch=1 if mode == "serial" else 16, budget=budget,
                    branch_k=1 if wide and mode != "plain" else 8)
    if model.scheduler is not None:  # every request prefills whole, as the serial line's do: no rows kept in a slot
        model.scheduler._slot = lambda prompt, free=model.scheduler.loop.free_slots: (free()[0], 0)
    if wide and mode == "glance":
        Seeded(model, workload)
    elif wide and mode == "serial":
        kinds = range(min(len(WIDE_PROMPTS), len(workload.prompts)))
        model.session.backend.keep_embeddings(sorted({t for i in kinds for t in workload.seeds(i)}))
    line = Line(model, workload) if mode == "serial" else None
    warm = WARM_EACH * concurrency if workload.model == "default" else 0
    counter = iter(range(-warm, count))  # the first `warm` (negative) are served and not counted
    arrived, first, done, tokens = {}, {}, {}, {}
    barrier = threading.Barrier(concurrency + 1)
    failed: list[BaseException] = []

    def client() -> None:
        barrier.wait()
        try:
            serve()
        except BaseException as exc:  # raised again on the main thread
            failed.append(exc)

    def serve() -> None:
        for i in counter:
            arrived[i] = time.perf_counter()
            if line is not None:
                tokens[i], first[i] = line.submit(i % count).result()
            else:
                out = model.submit(workload.prompts[i % count], max_new_tokens=workload.max_new).result()
                tokens[i] = out.token_ids
                first[i] = out.stats["queue_ms"] + out.stats["prefill_ms"]  # waiting for a slot, then its prefill
            done[i] = time.perf_counter()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    if line is not None:
        line.close()
    model.close()
    if failed:
        raise failed[0]
    wall = max(done[i] for i in range(count)) - arrived[0]
    latency = [(done[i] - arrived[i]) * 1e3 for i in range(count)]
    ttft = [first[i] for i in range(count)]
    total = sum(len(tokens[i]) for i in range(count))
    return {"mode": mode, "concurrency": concurrency, "requests": count, "tokens": total,
            "tokens_per_s": round(total / wall, 1),
            "latency_ms_p50": round(statistics.median(latency), 2), "latency_ms_p99": round(pct(latency, 0.99), 2),
            "ttft_ms_p50": round(statistics.median(ttft), 2), "ttft_ms_p99": round(pct(ttft, 0.99), 2),
            "answers": {i: tokens[i] for i in range(count)}}


class Line:
    """One request at a time, in arrival order (glance-serve --max-batch 1's queue): one worker thread decodes what
    the clients submit; each future gives the tokens and the ms from submission to the prefill's token."""

    def __init__(self, model, workload: Workload):
        import queue
        import threading

        self.model, self.workload = model, workload
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def submit(self, index: int):
        from concurrent.futures import Future

        future: Future = Future()
        self.queue.put((index, time.perf_counter(), future))
        return future

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            index, submitted, future = item
            waited = (time.perf_counter() - submitted) * 1e3
            try:
                tokens, prefill_ms = self._decode(index)
            except BaseException as exc:  # the client raises it
                future.set_exception(exc)
                continue
            future.set_result((tokens, waited + prefill_ms))

    def _decode(self, index: int) -> tuple[list[int], float]:
        """One request alone on the max_batch 1 model (the wide model's drafts seeded on its backend)."""
        workload = self.workload
        if workload.model != "wide":
            out = self.model.submit(workload.prompts[index], max_new_tokens=workload.max_new).result()
            return out.token_ids, out.stats["prefill_ms"]
        from glance_runtime.bench.seeding import ConfidentSeeds
        from glance_runtime.decode.loop import decode

        prompt = workload.prompts[index]
        backend = ConfidentSeeds(_Slot(self.model.session.backend), workload.seeds(index) + [0] * 8, prompt.length,
                                 "partial")
        result = decode(backend, prompt, workload.config("glance"), workload.stops)
        return result.tokens, result.prefill_ms


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
    from serve_load import medians

    runs = []
    load_before = os.getloadavg()[0]
    for repeat in range(args.repeats):
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            for mode in ("serial", "plain", "glance"):
                row = run_mode(workload, mode, concurrency, args.requests)
                want = reference["plain" if mode == "plain" else "glance"]
                row["same_as_alone"] = sum(row["answers"][i] == want[i] for i in range(args.requests))
                del row["answers"]
                runs.append(row)
                print(json.dumps({"repeat": repeat, **row}), flush=True)
    rows = medians(runs, ("concurrency", "mode"), counted=("requests", "tokens", "same_as_alone"))
    report = {"model": args.model, "threads": 1, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "load_before": load_before, "rows": rows}
    (out / f"batch_decode_{args.model}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"batch_decode_{args.model}.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    from serve_load import paired

    repeats = report.get("repeats", 1)
    lines = [f"# In-flight batching, {report['model']} model (ONNX Runtime CPU, 1 thread, "
             f"{report['requests']} requests a run)", "",
             f"Medians of {repeats} runs a row; the ratios are medians of each repeat's own (a level's three modes run "
             "back to back in a repeat).", "",
             "| clients | mode | tokens/s (runs) | vs plain | vs serial | latency p50 / p99 ms | TTFT p50 / p99 ms "
             "| same as alone |", "|---|---|---|---|---|---|---|---|"]
    rows = report["rows"]
    ratios = {(mode, base): paired(rows, 'concurrency', mode, base)
              for mode in ("serial", "plain", "glance") for base in ("plain", "serial")}
    for r in rows:
        runs_of = ", ".join(f"{t:.1f}" for t in r["tokens_per_s_runs"])
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['tokens_per_s']} ({runs_of}) | "
                     f"{ratios[r['mode'], 'plain'][r['concurrency']]:.2f} | "
                     f"{ratios[r['mode'], 'serial'][r['concurrency']]:.2f} | {r['latency_ms_p50']} / "
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
    r.add_argument("--repeats", type=int, default=1, help="the modes take turns this many times; medians reported")
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
