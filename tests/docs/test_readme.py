"""The README's code blocks run as written and give the answers they show.

Every `bash` and `python` block runs in order, in a scratch folder that sees the repository's `examples/`
and `models/` (so what a block writes stays out of the clone), with `.venv/bin/` standing for this
interpreter's folder. A block whose info string says `no-ci` is not run (the set-up itself, a Jetson's
steps); a `background` block is started as a server that the blocks after it talk to, on a free port in
place of the one written. A line ending in `# -> TEXT` must print TEXT, in order within its block."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import wait_until_ok

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKERS = {"no-ci", "background", "api-only"}
WRITTEN_PORT = "8000"
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    markers: frozenset[str]
    code: str

    @property
    def expected(self) -> list[str]:
        return [m.group(1).strip() for m in re.finditer(r"# -> (.+)$", self.code, re.M)]


def blocks(text: str) -> list[Block]:
    found = []
    for m in re.finditer(r"^```(\w+)([^\n]*)\n(.*?)^```$", text, re.M | re.S):
        found.append(Block(text[:m.start()].count("\n") + 1, m.group(1), frozenset(m.group(2).split()), m.group(3)))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _source(block: Block, port: int) -> str:
    return block.code.replace(".venv/bin/", f"{Path(sys.executable).parent}/").replace(WRITTEN_PORT, str(port))


def _check(block: Block, output: str) -> None:
    at = 0
    for answer in block.expected:
        found = output.find(answer, at)
        assert found >= 0, f"README line {block.line}: expected {answer!r} in order, got:\n{output[-3000:]}"
        at = found + len(answer)


def _wait_healthy(port: int, server: subprocess.Popen) -> None:
    if not wait_until_ok(f"http://127.0.0.1:{port}/health", server, 120):
        pytest.fail(f"the README's background server did not become healthy (exit code {server.poll()})")


@pytest.mark.edge
def test_the_set_up_lines_come_first_and_every_marker_is_known():
    first = blocks(README.read_text())[0]
    assert first.code.splitlines() == ["python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'",
                                       ".venv/bin/python -m pytest"]
    for block in blocks(README.read_text()):
        assert block.markers <= MARKERS, f"README line {block.line}: unknown marker {set(block.markers - MARKERS)}"


@pytest.mark.edge
def test_the_test_runs_are_described_without_counts_or_durations():
    """How many tests a run holds and how long it takes change with every test added and every machine, and no
    test here could keep such a figure true: the README names what each run covers, never how many or how long."""
    text = README.read_text()
    setup = text[:text.index("\n## ")]
    assert not re.findall(r"\b\d[\d,]* (?:tests|selected)\b", text)
    assert not re.findall(r"\b\d+(?:\.\d+)? ?(?:s|sec|seconds|min|minutes|h|hours)\b", setup)


@pytest.mark.edge
def test_ci_runs_the_readmes_set_up_and_test_commands_in_order():
    """CI must run what a new user is told to run: the commands of .ci/run are the README's first no-ci
    set-up and test lines, in the same order."""
    ci = [line for line in (README.parent / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    readme = [line for block in blocks(README.read_text()) if "no-ci" in block.markers and block.language == "bash"
              for line in block.code.splitlines() if line.startswith((".venv", "python3 -m venv"))]
    assert ci == readme[:len(ci)] and len(ci) >= 2, (ci, readme)


def test_readme_blocks_run_as_written(tmp_path):
    for name in ("examples", "models"):
        (tmp_path / name).symlink_to(ROOT / name)
    port = _free_port()
    servers: list[subprocess.Popen] = []
    ran = 0
    try:
        for block in blocks(README.read_text()):
            if "no-ci" in block.markers or block.language not in ("bash", "python"):
                continue
            command = ["bash", "-e", "-o", "pipefail", "-c"] if block.language == "bash" else [sys.executable, "-c"]
            if "background" in block.markers:
                servers.append(subprocess.Popen([*command, _source(block, port)], cwd=tmp_path,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                start_new_session=True))
                _wait_healthy(port, servers[-1])
                continue
            done = subprocess.run([*command, _source(block, port)], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
            output = done.stdout + done.stderr
            assert done.returncode == 0, f"README line {block.line} exited {done.returncode}:\n{output[-3000:]}"
            _check(block, done.stdout + "\n" + done.stderr)
            ran += 1
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    assert ran >= 5
    written = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert written, "the README's build example wrote nothing"
    assert not _tracked_if_written_in_the_clone(written), "run from the clone, the README would leave files git sees"


def _tracked_if_written_in_the_clone(paths: list[str]) -> list[str]:
    """Of these paths relative to the clone's root, those its .gitignore does not ignore (`git status` would list)."""
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"], input="\n".join(paths),
                             capture_output=True, text=True, timeout=60).stdout.splitlines()
    return sorted(set(paths) - set(ignored))


@pytest.mark.edge
def test_every_local_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link and not (page.parent / link).exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken
