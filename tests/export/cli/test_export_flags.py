"""glance-export's flags: every option of every subcommand described in --help with its default shown; --max-batch
bounded at parse by the bound the manifest readers apply; and int4's group size, by default the largest supported
one that divides the model's width, so the default exports the embedded model (192 wide), and an explicit one that
does not divide it is one line naming the ones that do."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from glance_export.cli import main as export_main
from glance_export.cli import parser
from glance_export.onnx.quant_scheme import GROUP_SIZES, check_scheme
from glance_runtime.defaults import DEFAULT_HEAD, DEFAULT_MODEL
from glance_runtime.errors import GlanceError
from glance_runtime.formats.common import MAX_BATCH

from support import export_refusal

REPO = Path(__file__).resolve().parents[3]
SKIPPED = (argparse._HelpAction, argparse._VersionAction)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def options(command: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in command._actions if a.option_strings and not isinstance(a, SKIPPED)]


@pytest.mark.parametrize("name", subcommands())
def test_every_option_of_every_subcommand_is_described(name):
    undescribed = [a.option_strings[-1] for a in options(subcommands()[name])
                   if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert not undescribed, f"glance-export {name}: {undescribed}"


def help_blocks(command: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's entry in the --help text, by its last option string (entries start at a line `  -`)."""
    blocks: dict[str, str] = {}
    current = None
    for line in command.format_help().splitlines():
        found = re.match(r"  (-[-\w]+)(?:, (--[-\w]+))?", line)
        if found:
            current = found.group(2) or found.group(1)
            blocks[current] = ""
        if current is not None:
            blocks[current] += " " + line.strip()
    return {flag: re.sub(r"\s+", " ", text) for flag, text in blocks.items()}


@pytest.mark.parametrize("name", subcommands())
def test_every_default_is_shown(name):
    command = subcommands()[name]
    blocks = help_blocks(command)
    hidden = []
    for action in options(command):
        default = action.default
        if default is None or default is False or default == [] or default == argparse.SUPPRESS:
            continue  # an unset flag: its help says what applies instead
        text = blocks[action.option_strings[-1]]
        if "default" not in text or str(default) not in text:
            hidden.append(f"{action.option_strings[-1]} (default {default})")
    assert not hidden, f"glance-export {name}: {hidden}"


def test_onnx_help_describes_its_flags_and_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        export_main(["onnx", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert exc.value.code == 0
    for shown in ("default: 17", "default: fp32", "default: 64", "default: 2048", f"1..{MAX_BATCH}"):
        assert shown in text, shown


@pytest.mark.parametrize("command", ["onnx", "build"])
def test_a_batch_above_what_the_readers_accept_is_refused_at_parse(command, tmp_path, capsys):
    out = tmp_path / "out"
    base = {"onnx": ["onnx", "--model", DEFAULT_MODEL, "--head", DEFAULT_HEAD],
            "build": ["build", "--target", "rtx", "--plan-only", "--model", DEFAULT_MODEL, "--head", DEFAULT_HEAD]}
    line = export_refusal(capsys, [*base[command], "--out", out, "--max-batch", MAX_BATCH + 1])
    assert f"--max-batch {MAX_BATCH + 1} is outside 1..{MAX_BATCH}" in line, line
    assert not out.exists()
    args = parser().parse_args([str(a) for a in [*base[command], "--out", out, "--max-batch", MAX_BATCH]])
    assert args.max_batch == MAX_BATCH


def test_the_default_group_size_is_the_largest_that_divides_the_width():
    assert [check_scheme("int4", None, hidden, "fp32").group_size for hidden in (192, 4096, 96, 160)] == [64, 128,
                                                                                                          32, 32]
    assert check_scheme("int4", 32, 192, "fp32").group_size == 32
    with pytest.raises(GlanceError, match="none of the supported group sizes 32, 64, 128 divides the hidden size 100"):
        check_scheme("int4", None, 100, "fp32")


def test_a_group_size_that_does_not_divide_the_width_names_the_ones_that_do(tmp_path, capsys):
    out = tmp_path / "q"
    line = export_refusal(capsys, ["onnx", "--model", DEFAULT_MODEL, "--head", DEFAULT_HEAD, "--out", out, "--quantize",
                            "int4", "--group-size", "128"])
    assert "--group-size 128 does not divide the hidden size 192" in line and "32 or 64" in line, line
    assert not out.exists()


def test_the_docs_int4_example_exports_the_embedded_model_at_the_default_group_size(tmp_path, capsys):
    """docs/export.md's quantized export, run as written (its output path moved into the test's folder)."""
    doc = (REPO / "docs" / "export.md").read_text()
    command = next(line.split("#")[0].split() for line in doc.splitlines()
                   if line.startswith("glance-export onnx") and "--quantize int4" in line)
    assert command[command.index("--model") + 1] == "models/glance-vl-tiny", command
    argv = [str(REPO / a) if a.startswith("models/") else a for a in command[1:]]
    argv[argv.index("--out") + 1] = str(tmp_path / "q")
    assert export_main(argv) == 0
    log = capsys.readouterr().out
    assert "group size 64: the largest of 32, 64, 128 that divides the hidden size 192" in log, log
    quantization = json.loads((tmp_path / "q" / "manifest.json").read_text())["quantization"]
    assert (quantization["scheme"], quantization["group_size"]) == ("int4", 64)
    assert max(GROUP_SIZES) == 128  # the group real models (widths that are multiples of 128) keep
