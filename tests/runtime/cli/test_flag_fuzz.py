"""Whatever text a numeric flag is given, every command's parser either accepts a value inside the flag's
range or refuses in one `error:` line with exit code 2: never a traceback, never NaN, infinity or a size
that would run until stopped."""
from __future__ import annotations

import io
import math
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glance_export.cli import parser as export_parser
from glance_runtime.cli.bench import bench_parser
from glance_runtime.cli.run import main as run_main, parser as run_parser
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
    (serve_parser, [], "--port", (-0.5, 65535)),  # 0 included: any free port
    (serve_parser, [], "--timeout", (0, math.inf)),
    (serve_parser, [], "--max-body-mb", (0, math.inf)),
    (serve_parser, [], "--max-queue", (1, 100_000)),
    (serve_parser, [], "--max-tokens", (1, 1 << 20)),
    (serve_parser, [], "--max-image-pixels", (1, 8192 * 8192)),
    (serve_parser, [], "--max-messages", (1, 100_000)),
    (export_parser, ["init-head", "--model", "m", "--out", "o"], "--layers", (1, 64)),
    (export_parser, ["init-head", "--model", "m", "--out", "o"], "--block-size", (2, 64)),
    (export_parser, ["init-head", "--model", "m", "--out", "o", "--arch", "eagle3"], "--draft-vocab", (1, math.inf)),
    (export_parser, ["train-head", "--model", "m", "--data", "t", "--out", "o", "--arch", "eagle3"], "--ttt-steps",
     (1, 7)),
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


PROMPT_TEXT = st.text(alphabet=st.one_of(st.characters(codec="utf-8", exclude_characters="\n"),
                                         st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                         st.characters(max_codepoint=0x1F, exclude_characters="\n")), max_size=30)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=PROMPT_TEXT, typed=st.lists(PROMPT_TEXT, min_size=1, max_size=3))
def test_any_prompt_text_answers_or_is_one_line(first, typed, capsys, monkeypatch):
    """glance-run with arbitrary text, lone surrogates and control characters included: as --prompt (text
    the shell could not pass is refused in one line) and as lines typed into --chat (a refused turn is one
    line and the chat carries on to the next)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in typed) + "/exit\n"))
    capsys.readouterr()
    try:
        code = run_main(["--prompt", first or "hi", "--chat", "--max-new-tokens", "2", "--budget", "7", "--threads",
                         "1"])
    except SystemExit as exc:  # argparse's own refusal (a prompt starting with '-' reads as a flag)
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if code == 2:
        assert err.count("error:") == 1 and "--prompt" in err and err.encode("utf-8")  # nothing unprintable echoed
        return
    assert code == 0
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) <= len(typed) + 1 and all("surrogate" in line or "context" in line for line in errors), err


def test_a_prompt_starting_with_a_dash_is_refused_with_the_way_to_pass_it(capsys):
    with pytest.raises(SystemExit) as refused:
        run_main(["--prompt", "-:", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1 and "--prompt" in err[0] and "--flag=-value" in err[0], err
