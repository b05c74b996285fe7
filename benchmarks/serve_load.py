"""Load on a live `glance-serve`: N clients x M requests each, and the time the server adds over the
in-process API.

    python benchmarks/serve_load.py                          # starts glance-serve (embedded default) itself
    python benchmarks/serve_load.py --clients 1,4,16 --requests 24 --served 3000 --out benchmarks/results/serve-load
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model glance-vl-tiny --no-overhead

Requests cycle through the held-out tasks of examples/*/tasks.jsonl (image as a data URL). Per load
level: throughput (requests and completion tokens per second), client latency p50/p99, the server's
queue wait (p50 and mean, as each answer reports it; the mean agrees with /metrics' histogram), tau
(pooled over requests), and the server's own time split from each answer's `glance` field:
`server_ms` (arrival at the app to the answer formed) minus the queue wait, `prepare_ms` (images decoded,
prompt built) and `decode_ms` (the API's decode) is what the server itself added; the client latency
minus `server_ms` is the rest (the client, the loopback, uvicorn's HTTP parsing and writing).

The overhead figure is paired, one request at a time: the benchmark's own process loads the same model
through the public API (`glance_runtime.load`, the same thread count) and alternates, per task, one
in-process decode with one HTTP request for the same task, in alternating order; it reports p50/p99 of
the differences. The in-process side opens the task's image file, as an application would, and decodes
through `Model.reuse()`, the calls the server makes, so both sides keep the same rows of the task before
(the chat template's first rows) and do the same decoding work. The HTTP request goes through a minimal
keep-alive client (a bare socket: the request, encoded beforehand, in one write; the answer read by its
Content-Length), so little of the difference is the client's; the round trip of GET /health through the
same client is reported beside it as the floor any HTTP request pays, back to back and after idling as
long as an in-process decode (as each paired HTTP request does: on a loaded machine, waking an idle
server's threads takes part of the difference, and none of it is the server's work). Where the benchmark
started the server, it also reads the server's threads' CPU time and run-queue wait
(/proc/PID/task/*/schedstat) across the paired requests, against the in-process decodes' CPU time: the
work the server adds, which other jobs on the machine disturb far less than wall time, split into the
event-loop thread's (everything HTTP: parsing, JSON, validation, the answer) and the decode thread's
excess over the in-process decode, and how long the server waited for a CPU because of them.
With `--served N` it then sends N more requests one at a time and reads the event-loop thread's CPU
per request every 100: what the server spends on a request should not grow with the requests it has
served (a leak, a growing structure, a slower garbage collection).
"""
from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
from PIL import Image

import glance_runtime as gr

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("receipt", "chart", "scene", "caption")
READY = re.compile(r"ready: .* on (http://\S+)")
MAX_TOKENS = 256  # the server's default and glance-run's


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


def medians(runs: list[dict], key: tuple[str, ...], counted: tuple[str, ...] = ()) -> list[dict]:
    """Rows of repeated runs merged per `key` (in first-seen order): each number the median of its repeats (the
    tokens/s of every repeat kept beside it), each `counted` field summed."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in key), []).append(run)
    merged = []
    for rows in groups.values():
        row = dict(rows[0])
        for name, value in rows[0].items():
            if name in counted:
                row[name] = sum(r[name] for r in rows)
            elif name not in key and isinstance(value, (int, float)):
                row[name] = round(statistics.median(r[name] for r in rows), 2)
        row["repeats"] = len(rows)
        row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in rows]
        merged.append(row)
    return merged


def paired(rows: list[dict], level: str, mode: str, base: str) -> dict:
    """Per `level`, the median over repeats of `mode`'s tokens/s over `base`'s in the same repeat (merged rows of
    `medians`; a repeat's runs are taken back to back, so its ratio is freer of the machine's drift than a ratio
    of medians)."""
    import statistics

    runs = {(r[level], r["mode"]): r["tokens_per_s_runs"] for r in rows}
    return {at: statistics.median(a / b for a, b in zip(runs[at, mode], runs[at, base]))
            for at, kind in runs if kind == mode}


def split(answer: dict, client_ms: float) -> tuple[float, float]:
    """(the server's own added ms, the ms outside the server) of one answer."""
    g = answer["glance"]
    return g["server_ms"] - g["queue_ms"] - g["prepare_ms"] - g["decode_ms"], client_ms - g["server_ms"]


def load(url: str, bodies: list[dict], clients: int, requests: int) -> dict:
    latencies: list[float] = []
    server: list[float] = []
    outside: list[float] = []
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
                    waits.append(answer["glance"]["queue_ms"])
                    added, rest = split(answer, dt * 1e3)
                    server.append(added)
                    outside.append(rest)
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
            "server_added_p50_ms": round(pct(server, 0.5), 2), "server_added_p99_ms": round(pct(server, 0.99), 2),
            "outside_server_p50_ms": round(pct(outside, 0.5), 2),
            "tau": round(sum(a["glance"]["tau"] * a["glance"]["rounds"] for a in answers) / max(rounds, 1), 3)}


class LeanClient:
    """One keep-alive HTTP/1.1 connection on a bare socket: the request goes out in one write and the answer
    is read by its Content-Length, the least a Python client can spend (http.client sends a request's
    headers and body in two writes, which costs the server an extra wake-up and read, and parses the
    answer's headers with the email package)."""

    def __init__(self, url: str):
        parts = urlparse(url)
        self.host = f"{parts.hostname}:{parts.port}".encode()
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=600)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = b""

    def _exchange(self, head: bytes, data: bytes = b"") -> bytes:
        self.sock.sendall(head + data)
        buffer = self.pending
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            buffer += self._recv()
        headers, buffer = buffer[:end], buffer[end + 4:]
        status = int(headers.split(b" ", 2)[1])
        match = re.search(rb"\r\ncontent-length: *(\d+)", headers, re.I)
        if match is None:
            raise SystemExit(f"the server answered without a Content-Length (status {status})")
        size = int(match.group(1))
        while len(buffer) < size:
            buffer += self._recv()
        self.pending = buffer[size:]
        if status != 200:
            raise SystemExit(f"the server answered {status}: {buffer[:size].decode(errors='replace')}")
        return buffer[:size]

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise SystemExit("the server closed the connection")
        return chunk

    def post(self, path: str, data: bytes) -> bytes:
        return self._exchange(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % (path.encode(), self.host, len(data)), data)

    def get(self, path: str) -> bytes:
        return self._exchange(b"GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path.encode(), self.host))

    def close(self) -> None:
        self.sock.close()


def schedstat(pid: int) -> tuple[float, float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process, summed over its threads, and the
    seconds on a CPU of its main thread alone (the server's event loop: HTTP, JSON, validation, the answer)."""
    on = waiting = loop = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # a thread that ended meanwhile
            continue
        on, waiting = on + int(fields[0]), waiting + int(fields[1])
        if task.name == str(pid):
            loop = int(fields[0])
    return on / 1e9, waiting / 1e9, loop / 1e9


def overhead(url: str, model_name: str, work: list[tuple[str, Path]], repeats: int, threads: int,
             server_pid: int | None) -> dict:
    """Paired, one request at a time: the same task in process (the public API) and over HTTP, alternating.
    Where the benchmark started the server, also the CPU time each side spent (less disturbed by other jobs
    than wall time) and how long the server's threads waited for a CPU."""
    model = gr.load(threads=threads)
    rows = model.reuse()
    client = LeanClient(url)
    payloads = [json.dumps(body(model_name, prompt, image)).encode() for prompt, image in work]

    local_cpu: list[float] = []

    def local(i: int) -> tuple[str, float]:
        prompt, image = work[i % len(work)]
        t0, cpu0 = time.perf_counter(), time.process_time()
        with Image.open(image) as img:
            messages = [{"role": "user", "content": [{"type": "image", "image": img.convert("RGB")},
                                                      {"type": "text", "text": prompt}]}]
        text = rows.decode(model.build(messages=messages), max_new_tokens=MAX_TOKENS).text
        local_cpu.append(time.process_time() - cpu0)
        return text, (time.perf_counter() - t0) * 1e3

    def remote(i: int) -> tuple[dict, float]:
        t0 = time.perf_counter()
        answer = json.loads(client.post("/v1/chat/completions", payloads[i % len(payloads)]))
        return answer, (time.perf_counter() - t0) * 1e3

    for i in range(len(work)):  # both sides warm on every task before anything is timed
        local(i), remote(i)
    diffs, in_process, over_http, server = [], [], [], []
    local_cpu.clear()
    server0 = schedstat(server_pid) if server_pid else None
    for i in range(repeats):
        if i % 2:
            answer, http_ms = remote(i)
            text, local_ms = local(i)
        else:
            text, local_ms = local(i)
            answer, http_ms = remote(i)
        if answer["choices"][0]["message"]["content"] != text:
            raise SystemExit(f"the server's answer to {work[i % len(work)][0]!r} differs from the in-process one")
        diffs.append(http_ms - local_ms)
        in_process.append(local_ms)
        over_http.append(http_ms)
        server.append(split(answer, http_ms)[0])
    server1 = schedstat(server_pid) if server_pid else None
    floor, after_idle = health_round_trips(client, 200, 0.0), health_round_trips(client, 48, statistics.median(in_process))
    client.close()
    model.close()
    return {"requests": repeats, "in_process_p50_ms": round(pct(in_process, 0.5), 2),
            "http_p50_ms": round(pct(over_http, 0.5), 2),
            "added_p50_ms": round(pct(diffs, 0.5), 2), "added_p99_ms": round(pct(diffs, 0.99), 2),
            "server_added_p50_ms": round(pct(server, 0.5), 2), "server_added_p99_ms": round(pct(server, 0.99), 2),
            "health_round_trip_p50_ms": round(pct(floor, 0.5), 2),
            "health_after_idle_p50_ms": round(pct(after_idle, 0.5), 2),
            **(cpu(server0, server1, local_cpu) if server0 else {})}


def cpu(before: tuple[float, float, float], after: tuple[float, float, float], local: list[float]) -> dict:
    """Per request: the server process's CPU time against the in-process decode's, split into the event loop's
    share (what only the server does) and the rest (the decode thread: what the in-process caller also does),
    and the server's wait for a CPU."""
    n = len(local)
    server_ms, local_ms = (after[0] - before[0]) / n * 1e3, sum(local) / n * 1e3
    loop_ms = (after[2] - before[2]) / n * 1e3
    return {"server_cpu_ms": round(server_ms, 2), "in_process_cpu_ms": round(local_ms, 2),
            "cpu_added_ms": round(server_ms - local_ms, 2), "server_loop_cpu_ms": round(loop_ms, 2),
            "decode_side_cpu_added_ms": round(server_ms - loop_ms - local_ms, 2),
            "server_runqueue_wait_ms": round((after[1] - before[1]) / n * 1e3, 2)}


def health_round_trips(client: LeanClient, n: int, idle_ms: float) -> list[float]:
    """GET /health round trips, each after `idle_ms` asleep: after an in-process decode's worth of idling, the
    server's threads have to be woken and scheduled again, which on a busy machine is most of what HTTP adds."""
    out = []
    for _ in range(n):
        time.sleep(idle_ms / 1e3)
        t0 = time.perf_counter()
        client.get("/health")
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def served(url: str, work: list[tuple[str, Path]], model_name: str, total: int, server_pid: int) -> list[float]:
    """The event-loop thread's CPU ms per request, per 100 requests, over `total` sent one at a time to one
    server: whether what the server spends on a request grows with the requests it has served."""
    client = LeanClient(url)
    payloads = [json.dumps(body(model_name, prompt, image)).encode() for prompt, image in work]
    out = []
    for start in range(0, total, 100):
        n = min(100, total - start)
        before = schedstat(server_pid)[2]
        for i in range(start, start + n):
            client.post("/v1/chat/completions", payloads[i % len(payloads)])
        out.append(round((schedstat(server_pid)[2] - before) / n * 1e3, 2))
    client.close()
    return out


def markdown(report: dict) -> str:
    rows = ["| clients | requests | req/s | tokens/s | latency p50 ms | p99 ms | queue wait p50 ms | mean | tau "
            "| server added p50 ms | p99 ms | outside the server p50 ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows += [f"| {r['clients']} | {r['requests']} | {r['requests_per_s']} | {r['tokens_per_s']} | {r['latency_p50_ms']} "
             f"| {r['latency_p99_ms']} | {r['queue_wait_p50_ms']} | {r['queue_wait_mean_ms']} | {r['tau']} "
             f"| {r['server_added_p50_ms']} | {r['server_added_p99_ms']} | {r['outside_server_p50_ms']} |"
             for r in report["load"]]
    rows += ["", "server added: the answer's server_ms (arrival at the app to the answer formed) minus its queue wait, "
             "prepare and decode times; outside the server: the client's latency minus server_ms (httpx, the "
             "loopback, uvicorn's HTTP parsing and writing)."]
    if o := report.get("overhead"):
        rows += ["", f"Paired with the in-process API (`Model.reuse().decode` in the benchmark's process, as the "
                 f"server decodes; same model and threads), one request at a time, {o['requests']} requests over a minimal keep-alive socket client: "
                 f"**{o['added_p50_ms']} ms added at p50** (p99 {o['added_p99_ms']} ms; in process "
                 f"{o['in_process_p50_ms']} ms, HTTP {o['http_p50_ms']} ms). Inside the server: "
                 f"{o['server_added_p50_ms']} ms at p50 (p99 {o['server_added_p99_ms']} ms). GET /health round trip "
                 f"through the same client: {o['health_round_trip_p50_ms']} ms at p50 back to back, "
                 f"{o['health_after_idle_p50_ms']} ms after idling as long as an in-process decode."]
        if "cpu_added_ms" in o:
            rows += ["", f"CPU time per request: the server process {o['server_cpu_ms']} ms, the in-process decode "
                     f"{o['in_process_cpu_ms']} ms: **{o['cpu_added_ms']} ms of work added**, of which the "
                     f"event-loop thread (HTTP, JSON, validation, the answer) spent {o['server_loop_cpu_ms']} ms and "
                     f"the decode thread {o['decode_side_cpu_added_ms']:+} ms against the in-process decode; the "
                     f"server's threads "
                     f"waited {o['server_runqueue_wait_ms']} ms per request for a CPU (other jobs on the machine)."]
    if g := report.get("served"):
        rows += ["", f"The event-loop thread's CPU per request over {g['requests']} more requests one at a time, "
                 f"per 100: {', '.join(map(str, g['loop_cpu_ms_per_100']))} ms."]
    parser = f"; uvicorn's HTTP parser: {report['http_parser']}" if "http_parser" in report else ""
    rows += ["", f"Machine: {report['machine']}{parser}."]
    return "\n".join(rows) + "\n"


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running glance-serve (default: start one with the embedded model)")
    p.add_argument("--model", default="glance-vl-tiny", help="the served model name")
    p.add_argument("--clients", default="1,4,16", help="comma-separated load levels")
    p.add_argument("--requests", type=int, default=24, help="requests per client")
    p.add_argument("--per-kind", type=int, default=6, help="held-out tasks per kind")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (server and in-process)")
    p.add_argument("--overhead-requests", type=int, default=192, help="paired requests against the in-process API")
    p.add_argument("--no-overhead", action="store_true", help="skip the in-process comparison")
    p.add_argument("--served", type=int, default=0, metavar="N",
                   help="then N requests one at a time, the event loop's CPU per request read every 100 (a server "
                        "this benchmark started)")
    p.add_argument("--out", type=Path, help="directory for report.json and report.md")
    args = p.parse_args()
    work = tasks(args.per_kind)
    started = load_average()
    proc, url = (None, args.url) if args.url else start_server(args.threads)
    try:
        bodies = [body(args.model, prompt, image) for prompt, image in work]
        load(url, bodies, 1, 2)  # warm the connection path
        report: dict = {"url": url, "model": args.model, "tasks": len(work), "threads": args.threads, "load": []}
        if proc is not None:  # the server runs in this interpreter's environment: uvicorn picks the same parser
            report["http_parser"] = "httptools" if importlib.util.find_spec("httptools") else "h11"
        for clients in (int(c) for c in args.clients.split(",")):
            report["load"].append(load(url, bodies, clients, args.requests))
            print(json.dumps(report["load"][-1]), file=sys.stderr)
        if not args.no_overhead:
            report["overhead"] = overhead(url, args.model, work, args.overhead_requests, args.threads,
                                          proc.pid if proc else None)
            print(json.dumps(report["overhead"]), file=sys.stderr)
        if args.served and proc is not None:
            report["served"] = {"requests": args.served,
                                "loop_cpu_ms_per_100": served(url, work, args.model, args.served, proc.pid)}
            print(json.dumps(report["served"]), file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    report["machine"] = (f"{os.cpu_count()} cores; load average (1, 5, 15 min) {started} at the start, "
                         f"{load_average()} at the end")
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "report.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
