"""A calibration.json beside a head or export (or named by `glance-bench --calibration`) is typed before it is
read: a FIFO, a directory or a link loop is named as what it is, never skipped as absent or opened to block. The
FIFO cases run in a child with a deadline, so a regression fails instead of hanging."""
from __future__ import annotations

import subprocess
import sys

import pytest

from glance_runtime.decode.calibration import PRIOR, find_calibration
from support import KIND_WORDS, one_line_refusal, replace_with

pytestmark = pytest.mark.edge

CHILD_TIMEOUT_S = 60
IN_CHILD = ("import sys\nfrom pathlib import Path\nfrom glance_runtime.errors import GlanceError\n"
            "from glance_runtime.decode.calibration import find_calibration, load_calibration\n"
            "try:\n    (find_calibration([Path(sys.argv[1])]) if sys.argv[2] == 'find' else "
            "load_calibration(Path(sys.argv[1]) / 'calibration.json'))\n"
            "except GlanceError as exc:\n    sys.exit(print(exc, file=sys.stderr) or 1)\n")


@pytest.mark.parametrize("call", ["find", "load"])
@pytest.mark.parametrize("shape", list(KIND_WORDS))
def test_a_calibration_of_another_kind_is_named_and_never_blocks(tmp_path, shape, call):
    replace_with(tmp_path / "calibration.json", shape)
    run = subprocess.run([sys.executable, "-c", IN_CHILD, str(tmp_path), call], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    assert run.returncode == 1
    one_line_refusal(run, f"{tmp_path / 'calibration.json'} {KIND_WORDS[shape]}")


def test_no_calibration_beside_a_head_is_the_prior(tmp_path):
    assert find_calibration([tmp_path, None]) == (PRIOR, None)
