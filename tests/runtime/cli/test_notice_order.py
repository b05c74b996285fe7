"""`glance-run` on a terminal, where stdout and stderr share one screen: a notice that comes while the answer streams
(auto's "cost profile refined ...", said mid-decode) waits until the answer's line has ended, so the answer is
always one whole line. Each run is a subprocess whose stdout and stderr are the same pipe, as a terminal's are."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import BLOCK_TRAINING_STACK, RECEIPT, glance_run

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

RUN = BLOCK_TRAINING_STACK + "from glance_runtime.cli.run import main; sys.exit(main(sys.argv[1:]))"
TIMEOUT_S = 300
RUNS = 3  # each on a fresh cache: measured at load, then refined (and said so) while the answer streams


def _merged(code: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The lines of a Python process whose stderr is its stdout's pipe."""
    done = subprocess.run([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S, env=env, check=True)
    return done.stdout.splitlines()


def test_a_notice_said_while_the_answer_streams_follows_the_answers_line():
    lines = _merged(BLOCK_TRAINING_STACK + """
from glance_runtime.cli.run import Terminal
t = Terminal()
t.notice("measured before")
t.write("The total is 37")
t.notice("cost profile refined from this decode's round timings")
t.write(".19.")
t.end()
t.notice("said after")
t.write("partial")
t.end(always=False)
t.end(always=False)
""")
    assert lines == ["measured before", "The total is 37.19.", "cost profile refined from this decode's round timings",
                     "said after", "partial"]


def test_glance_runs_answer_is_one_whole_line_whatever_it_says_meanwhile(tmp_path):
    prompt = "What is the total?"
    answer = glance_run(prompt, RECEIPT)["text"]
    for run in range(RUNS):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLANCE_CACHE": str(tmp_path / f"cache{run}")}
        lines = _merged(RUN, "--prompt", prompt, "--image", str(RECEIPT), "--threads", "1", env=env)
        stats = next(i for i, line in enumerate(lines) if line.startswith("[onnxruntime] tau"))
        assert answer in lines[:stats], lines
        assert any(line.startswith("cost profile stored") for line in lines), lines  # it did say notices
