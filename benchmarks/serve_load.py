"""Load on a live `glance-serve`: N clients x M requests each, and what HTTP adds over the in-process API.

    python benchmarks/serve_load.py                          # starts glance-serve (embedded default) itself
    python benchmarks/serve_load.py --clients 1,4,16 --requests 24 --out benchmarks/results/serve-load
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model glance-vl-tiny --no-overhead

Requests cycle through the held-out tasks of examples/*/tasks.jsonl (image as a data URL). Per load
level: throughput (requests and completion tokens per second), client latency p50/p99, the server's
queue wait (p50 and mean, as each answer reports it; the mean agrees with /metrics' histogram), tau
(pooled over requests) and the time the server adds over the in-process API: each answer's client
latency minus its queue wait and the server's own prepare (images, tokens) and decode times, which
are what an in-process caller spends (all four in the answer's `glance` field).
A second figure alternates one in-process decode here (the same adapter, prompt and thread count) with
one HTTP request and reports the median of the paired differences (it also counts two processes
sharing the CPU caches).
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

import httpx
from PIL import Image

from glance_runtime.serve.engine import Engine, ModelSpec

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("receipt", "chart", "scene", "caption")
READY = re.compile(r"ready: .* on (http://\S+)")


def tasks(per_kind: int) -> list[tuple[str, Path]]:
    out = []
    for kind in KINDS:
        lines = (ROOT / "examples" / kind / "tasks.jsonl").read_text().splitlines()[:per_kind]
        out += [(t["prompt"], ROOT / "examples" / kind / t["image"]) for t in map(json.loads, lines)]
    return out


def body(model: str, prompt: str, image: Path) -> dict:
    url = f"data:image/png;base64,{base64.b64encode(image.read_bytes()).decode()}"
    return {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]}]}


def start_server(threads: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "glance_runtime.serve", "--port", "0", "--threads", str(threads),
                             "--max-queue", "1024"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    for line in proc.stderr:
        print(line.rstrip(), file=sys.stderr)
        if match := READY.search(line):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep the pipe drained
            return proc, match.group(1)
    raise SystemExit("glance-serve exited before it was ready")


def queue_wait(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    value = {k: float(v) for k, v in re.findall(r"^glance_queue_wait_seconds_(sum|count) (\S+)$", text, re.M)}
    return value.get("sum", 0.0), value.get("count", 0.0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def load(url: str, bodies: list[dict], clients: int, requests: int) -> dict:
    latencies: list[float] = []
    added: list[float] = []
    waits: list[float] = []
    answers: list[dict] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        with httpx.Client(timeout=600) as http:
            barrier.wait()
            for i in range(requests):
                payload = bodies[(i * clients + index) % len(bodies)]  # clients ask different tasks at once
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/chat/completions", json=payload)
                dt = time.perf_counter() - t0
                r.raise_for_status()
                answer = r.json()
                with lock:
                    latencies.append(dt)
                    g = answer["glance"]
                    waits.append(g["queue_ms"])
                    added.append(dt * 1e3 - g["queue_ms"] - g["prepare_ms"] - g["decode_ms"])
                    answers.append(answer)

    wait0 = queue_wait(url)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    wait1 = queue_wait(url)
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    rounds = sum(a["glance"]["rounds"] for a in answers)
    return {"clients": clients, "requests": len(answers), "wall_s": round(wall, 3),
            "requests_per_s": round(len(answers) / wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "latency_p50_ms": round(pct(latencies, 0.5) * 1e3, 1), "latency_p99_ms": round(pct(latencies, 0.99) * 1e3, 1),
            "queue_wait_p50_ms": round(pct(waits, 0.5), 1), "queue_wait_mean_ms": round(statistics.mean(waits), 1),
            "metrics_queue_wait_mean_ms": round((wait1[0] - wait0[0]) / max(wait1[1] - wait0[1], 1) * 1e3, 1),
            "added_p50_ms": round(pct(added, 0.5), 2),
            "tau": round(sum(a["glance"]["tau"] * a["glance"]["rounds"] for a in answers) / max(rounds, 1), 3)}


def overhead(url: str, model: str, work: list[tuple[str, Path]], repeats: int, threads: int) -> dict:
    """Paired: the same prompt in process, then over HTTP (one client), alternating."""
    engine = Engine(ModelSpec(threads=threads))
    engine.warm()
    diffs, local, remote = [], [], []
    with httpx.Client(timeout=600) as http:
        for i in range(repeats):
            prompt, image = work[i % len(work)]
            payload = body(model, prompt, image)
            t0 = time.perf_counter()
            with Image.open(image) as img:
                messages = [{"role": "user", "content": [{"type": "image", "image": img.convert("RGB")},
                                                          {"type": "text", "text": prompt}]}]
            done = engine.complete(engine.prepare(messages, 256), 256)
            t1 = time.perf_counter()
            answer = http.post(f"{url}/v1/chat/completions", json=payload).json()
            t2 = time.perf_counter()
            if answer["choices"][0]["message"]["content"] != done.text:
                raise SystemExit(f"the server's answer to {prompt!r} differs from the in-process one")
            local.append(t1 - t0)
            remote.append(t2 - t1)
            diffs.append((t2 - t1) - (t1 - t0))
    engine.close()
    return {"requests": repeats, "in_process_p50_ms": round(statistics.median(local) * 1e3, 2),
            "http_p50_ms": round(statistics.median(remote) * 1e3, 2),
            "added_p50_ms": round(statistics.median(diffs) * 1e3, 2)}


def markdown(report: dict) -> str:
    rows = ["| clients | requests | req/s | tokens/s | latency p50 ms | p99 ms | queue wait p50 ms | mean | tau "
            "| added p50 ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows += [f"| {r['clients']} | {r['requests']} | {r['requests_per_s']} | {r['tokens_per_s']} | {r['latency_p50_ms']} "
             f"| {r['latency_p99_ms']} | {r['queue_wait_p50_ms']} | {r['queue_wait_mean_ms']} | {r['tau']} "
             f"| {r['added_p50_ms']} |" for r in report["load"]]
    rows += ["", "added: client latency minus the answer's queue wait, prepare and decode time."]
    if o := report.get("overhead"):
        rows += ["", f"Paired with an in-process decode in the benchmark's own process, one client, {o['requests']} "
                 f"requests: {o['added_p50_ms']} ms added at p50 (in process {o['in_process_p50_ms']} ms, "
                 f"HTTP {o['http_p50_ms']} ms)."]
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running glance-serve (default: start one with the embedded model)")
    p.add_argument("--model", default="glance-vl-tiny", help="the served model name")
    p.add_argument("--clients", default="1,4,16", help="comma-separated load levels")
    p.add_argument("--requests", type=int, default=24, help="requests per client")
    p.add_argument("--per-kind", type=int, default=6, help="held-out tasks per kind")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (server and in-process)")
    p.add_argument("--overhead-requests", type=int, default=48)
    p.add_argument("--no-overhead", action="store_true", help="skip the in-process comparison")
    p.add_argument("--out", type=Path, help="directory for report.json and report.md")
    args = p.parse_args()
    work = tasks(args.per_kind)
    proc, url = (None, args.url) if args.url else start_server(args.threads)
    try:
        bodies = [body(args.model, prompt, image) for prompt, image in work]
        load(url, bodies, 1, 2)  # warm the connection path
        report: dict = {"url": url, "model": args.model, "tasks": len(work), "threads": args.threads, "load": []}
        for clients in (int(c) for c in args.clients.split(",")):
            report["load"].append(load(url, bodies, clients, args.requests))
            print(json.dumps(report["load"][-1]), file=sys.stderr)
        if not args.no_overhead:
            report["overhead"] = overhead(url, args.model, work, args.overhead_requests, args.threads)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "report.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
