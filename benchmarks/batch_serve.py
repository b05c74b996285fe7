"""glance-serve under N concurrent clients: batched GLANCE against batched plain decoding and one request at a time.

Three servers on the embedded default (ONNX Runtime CPU, `--threads`), started together on loopback and asked
in turn (the two idle ones wait without work):
`glance` (`--max-batch B`, the default budget: auto), `plain` (`--max-batch B --budget 0`) and `serial`
(`--max-batch 1`, what every server did before batching). For each concurrency, N clients (the official `openai`
client, streamed) each send their next request when their last answer is complete, cycling through the example
tasks (image as a data URL); per request: time to first token (the first streamed text), latency (the last one)
and completion tokens; per level: tokens per second over the wall time, p50/p99 of both times. Each level is
first run untimed with 8 requests a client (the batch's auto settles to the load before it is measured). Every
answer's text is compared with the same task's answer from the serial server at concurrency 1 (the request sent
alone).

With `--repeats N` every level is measured N times, its three servers back to back each time; each figure is the
median of its N runs (every run's tokens/s kept beside it) and each ratio the median of the N repeats' own: one
run's tokens/s swings by a tenth or more on a shared machine, more than the differences measured.

    python benchmarks/batch_serve.py OUT [--concurrency 1,2,4,8,16] [--requests 64] [--max-batch 8] [--threads 1]
                                         [--repeats 1]
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_load import medians, paired, pct  # noqa: E402

KINDS = ("receipt", "chart", "scene", "caption")
READY = re.compile(r"ready: .* on (http://\S+)")
MODES = {"serial": ("--max-batch", "1"), "plain": ("--budget", "0"), "glance": ()}
WARM_EACH = 8  # requests a client sends untimed before each counted level


def tasks() -> list[tuple[str, str]]:
    out = []
    for kind in KINDS:
        for line in (ROOT / "examples" / kind / "tasks.jsonl").read_text().splitlines():
            task = json.loads(line)
            image = (ROOT / "examples" / kind / task["image"]).read_bytes()
            out.append((task["prompt"], f"data:image/png;base64,{base64.b64encode(image).decode()}"))
    return out


def start(mode: str, max_batch: int, threads: int) -> tuple[subprocess.Popen, str]:
    args = ["--max-batch", str(max_batch), *MODES[mode]] if mode != "serial" else list(MODES[mode])
    proc = subprocess.Popen([sys.executable, "-m", "glance_runtime.serve", "--port", "0", "--threads", str(threads),
                             "--max-queue", "1024", *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    for line in proc.stderr:
        if match := READY.search(line):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, match.group(1)
    raise SystemExit(f"glance-serve ({mode}) exited before it was ready")


def ask(client, model: str, prompt: str, image: str) -> tuple[str, float, float, int]:
    """(text, ms to the first text, ms to the end, completion tokens) of one streamed request."""
    t0 = time.perf_counter()
    first, pieces, tokens = None, [], 0
    stream = client.chat.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": [
                                                {"type": "image_url", "image_url": {"url": image}},
                                                {"type": "text", "text": prompt}]}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return "".join(pieces), ((first or end) - t0) * 1e3, (end - t0) * 1e3, tokens


def level(url: str, work: list[tuple[str, str]], clients: int, requests: int) -> tuple[dict, dict[int, str]]:
    from openai import OpenAI

    model = OpenAI(base_url=f"{url}/v1", api_key="none").models.list().data[0].id
    texts: dict[int, str] = {}
    ttft, latency, tokens = [], [], []
    lock = threading.Lock()
    counter = iter(range(requests))
    barrier = threading.Barrier(clients + 1)

    def client() -> None:
        api = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        barrier.wait()
        for i in counter:
            text, first, last, count = ask(api, model, *work[i % len(work)])
            with lock:
                texts[i] = text
                ttft.append(first)
                latency.append(last)
                tokens.append(count)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": requests, "tokens_per_s": round(sum(tokens) / wall, 1),
            "latency_ms_p50": round(statistics.median(latency), 1), "latency_ms_p99": round(pct(latency, 0.99), 1),
            "ttft_ms_p50": round(statistics.median(ttft), 1), "ttft_ms_p99": round(pct(ttft, 0.99), 1)}, texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    work = tasks()
    levels = [int(c) for c in args.concurrency.split(",")]
    runs, alone = [], None
    load_before = os.getloadavg()[0]
    servers = {mode: start(mode, args.max_batch, args.threads) for mode in MODES}  # idle but one at a time
    try:
        _, alone = level(servers["serial"][1], work, 1, len(work))
        for repeat in range(args.repeats):
            for clients in levels:
                for mode, (_, url) in servers.items():
                    level(url, work, clients, WARM_EACH * clients)  # warm at this load: auto settles to it
                    row, texts = level(url, work, clients, args.requests)
                    row["mode"] = mode
                    row["same_as_alone"] = sum(texts[i] == alone[i % len(work)] for i in texts)
                    runs.append(row)
                    print(json.dumps({"repeat": repeat, **row}), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    rows = medians(runs, ("clients", "mode"), counted=("requests", "same_as_alone"))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"max_batch": args.max_batch, "threads": args.threads, "requests": args.requests,
              "repeats": args.repeats, "load_before": load_before, "rows": rows}
    (args.out / "batch_serve.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# glance-serve, embedded default, ONNX Runtime CPU ({args.threads} thread), --max-batch {args.max_batch}",
             "", f"Medians of {args.repeats} runs a row; the ratios are medians of each repeat's own (a level's three "
             "servers are measured back to back in a repeat).", "",
             "| clients | mode | tokens/s (runs) | vs plain | vs serial | latency p50 / p99 ms | TTFT p50 / p99 ms "
             "| same as alone |", "|---|---|---|---|---|---|---|---|"]
    ratios = {(mode, base): paired(rows, 'clients', mode, base)
              for mode in MODES for base in ("plain", "serial")}
    for r in sorted(rows, key=lambda r: (r["clients"], list(MODES).index(r["mode"]))):
        runs_of = ", ".join(f"{t:.0f}" for t in r["tokens_per_s_runs"])
        lines.append(f"| {r['clients']} | {r['mode']} | {r['tokens_per_s']} ({runs_of}) | "
                     f"{ratios[r['mode'], 'plain'][r['clients']]:.2f} | "
                     f"{ratios[r['mode'], 'serial'][r['clients']]:.2f} | {r['latency_ms_p50']} / "
                     f"{r['latency_ms_p99']} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} | "
                     f"{r['same_as_alone']}/{r['requests']} |")
    (args.out / "batch_serve.md").write_text("\n".join(lines) + "\n")
    _plot(args.out, rows)
    return 0


def _plot(out: Path, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["clients"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("completion tokens / s")
    ax.set_title("glance-serve, embedded default, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "batch_serve.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
