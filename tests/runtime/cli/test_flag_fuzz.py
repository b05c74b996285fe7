"""Whatever text a numeric flag is given, every command's parser either accepts a value inside the flag's
range or refuses in one `error:` line with exit code 2: never a traceback, never NaN, infinity or a size
that would run until stopped."""
from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glance_export.cli import parser as export_parser
from glance_runtime.cli.bench import bench_parser
from glance_runtime.cli.run import parser as run_parser
from glance_runtime.cli.serve import parser as serve_parser

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

# (parser, the arguments it needs besides the flag, flag, the accepted range)
FLAGS = [
    (run_parser, ["--prompt", "p"], "--max-new-tokens", (1, math.inf)),
    (run_parser, ["--prompt", "p"], "--branch-k", (1, math.inf)),
    (run_parser, ["--prompt", "p"], "--threads", (1, None)),
    (run_parser, ["--prompt", "p"], "--max-context", (-math.inf, math.inf)),  # ranged by the backend at load
    (bench_parser, ["--data", "t.jsonl", "--out", "o"], "--max-new-tokens", (2, math.inf)),
    (bench_parser, ["--data", "t.jsonl", "--out", "o"], "--branch-k", (1, math.inf)),
    (serve_parser, [], "--threads", (1, None)),
    (export_parser, ["init-head", "--model", "m", "--out", "o"], "--layers", (1, 64)),
    (export_parser, ["init-head", "--model", "m", "--out", "o"], "--block-size", (2, 64)),
    (export_parser, ["corpus", "--out", "o", "--kind", "receipt"], "--n", (1, 1_000_000)),
    (export_parser, ["train-head", "--model", "m", "--data", "t", "--out", "o"], "--steps", (1, 10_000_000)),
    (export_parser, ["onnx", "--model", "m", "--head", "h", "--out", "o"], "--max-tree", (1, math.inf)),
    (export_parser, ["build", "--target", "rtx", "--out", "o"], "--memory-gib", (0, math.inf)),
]

TEXT = st.one_of(st.text(max_size=12), st.integers(-10**12, 10**12).map(str),
                 st.floats(allow_nan=True, allow_infinity=True).map(str),
                 st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "-1", "1.5", " 3 ", "0x10", "1_000"]))


def _parse(make, base: list[str], flag: str, text: str):
    """The parsed value, or None where the parser refused (SystemExit 2)."""
    args = make().parse_args([*base, flag, text])
    return getattr(args, flag.lstrip("-").replace("-", "_"))


@pytest.mark.parametrize("make, base, flag, bounds", FLAGS, ids=[f"{m.__module__}:{f}" for m, _, f, _ in FLAGS])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_numeric_flags_parse_in_range_or_refuse_in_one_line(make, base, flag, bounds, text, capsys):
    if text.startswith("-"):
        text = f" {text}"  # argparse would read a leading dash as another flag
    capsys.readouterr()  # the fixture is shared by every example: start each from an empty capture
    try:
        value = _parse(make, base, flag, text)
    except SystemExit as exc:
        err = capsys.readouterr().err.strip()
        assert exc.code == 2 and "\n" not in err and ": error: " in err and "Traceback" not in err, err
        return
    low, high = bounds
    high = (os.cpu_count() or 1) if high is None else high
    assert isinstance(value, (int, float)) and math.isfinite(value), value
    assert low <= value <= high if low != 0 else 0 < value <= high, (flag, text, value)
