"""Live `glance-serve` processes on loopback ports for the server tests, and `glance-run`'s answers."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from edge_install import BLOCK_TRAINING_STACK
from glance_runtime.cli.run import main as run_main

REPO = Path(__file__).resolve().parents[1]
RECEIPT = REPO / "examples" / "receipt" / "images" / "receipt_000.png"
MODEL_NAME = "glance-vl-tiny"
START_TIMEOUT_S = 120
READY = re.compile(r"ready: .* on (http://\S+)")
LISTENING = re.compile(r"listening on (http://[^;\s]+)")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


SERVE = BLOCK_TRAINING_STACK + "from glance_runtime.cli.serve import main; sys.exit(main(sys.argv[1:]))"


def start_server(*args: str, timeout_s: float = START_TIMEOUT_S,
                 on_listening: Callable[[str], None] | None = None) -> Server:
    """`glance-serve --port 0 ARGS` as an edge install runs it (no torch, transformers or glance_export),
    returned once it prints that it is ready."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "--port", "0", "--threads", "1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    log: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(deadline - time.monotonic(), 0)):
            break
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line.rstrip())
        if on_listening and (match := LISTENING.search(line)):
            on_listening(match.group(1))
        if match := READY.search(line):
            sel.close()
            return Server(proc, match.group(1), log)
    sel.close()
    proc.kill()
    proc.wait(timeout=30)
    raise AssertionError("glance-serve did not become ready:\n" + "\n".join(log))


def data_url(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"


def user(text: str, image_url: str | None = None) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": image_url}}] if image_url else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def glance_run(prompt: str, image: Path | None = None, max_new_tokens: int | None = None) -> dict:
    """`glance-run --json` in this process (same defaults, same cache)."""
    argv = ["--prompt", prompt, "--json", "--threads", "1"]
    argv += ["--image", str(image)] if image else []
    argv += ["--max-new-tokens", str(max_new_tokens)] if max_new_tokens else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert run_main(argv) == 0
    return json.loads(out.getvalue())
