"""Settings of train-head and prepare-head-data that cannot train: each refused in one line that names the flag,
before any model is loaded or any output written."""
from __future__ import annotations

import json

import pytest

from glance_export.cli import parser
from glance_export.model.vocab_choice import check_size
from glance_runtime.defaults import BRANCH_K
from glance_runtime.errors import GlanceError

from support import export_refusal


@pytest.fixture
def tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    return path


TRAIN_ONLY = [("--lr", "nan"), ("--lr", "-1"), ("--lr", "inf"), ("--lr", "0"), ("--anchors", "0"),
              ("--seed", "1" * 20), ("--seed", "-1"), ("--gamma", "0"), ("--gamma", "nan"), ("--time-budget", "-1"),
              ("--time-budget", "nan"), ("--time-budget", "inf"), ("--checkpoint-every", "0"), ("--draft-vocab", str(BRANCH_K - 1))]
BOTH = [("--max-new-tokens", "0"), ("--gen-batch", "0"), ("--gen-batch", "99999")]
CASES = [("train-head", *case) for case in TRAIN_ONLY + BOTH] + [("prepare-head-data", *case) for case in BOTH]


@pytest.mark.parametrize("command, flag, value", CASES)
def test_a_flag_outside_its_range_is_refused_by_name(command, flag, value, tasks, tmp_path, capsys):
    out = tmp_path / "out"
    line = export_refusal(capsys, [command, "--model", tmp_path / "model", "--data", tasks, "--out", out, flag, value])
    assert f"{flag} " in line and "pass" in line, line
    assert not out.exists()


@pytest.mark.parametrize("given", [["--eval-every", "5"], ["--eval-budget", "15"],
                                   ["--eval-every", "0", "--eval-budget", "7"]])
def test_held_out_settings_without_held_out_data_are_refused(given, tasks, tmp_path, capsys):
    out = tmp_path / "out"
    line = export_refusal(capsys, ["train-head", "--model", tmp_path / "model", "--data", tasks, "--out", out, *given])
    assert "--eval-data" in line and all(flag in line for flag in given[::2]), line
    assert not out.exists()


def test_the_ranges_keep_every_setting_that_trains(tmp_path):
    args = parser().parse_args(["train-head", "--model", "m", "--out", "o", "--seed", str(2**32 - 1), "--lr", "1e-4",
                                "--gen-batch", "1", "--draft-vocab", str(BRANCH_K), "--time-budget", "0"])
    assert (args.seed, args.lr, args.gen_batch, args.draft_vocab, args.time_budget) == (2**32 - 1, 1e-4, 1,
                                                                                        BRANCH_K, 0)  # 0: one step
    assert args.eval_every is None and args.eval_budget is None  # unset: the library's defaults apply


def test_a_draft_vocabulary_below_the_branching_is_refused_by_the_library_too():
    with pytest.raises(GlanceError, match=f"--draft-vocab {BRANCH_K - 1}"):
        check_size(BRANCH_K - 1, 1000)
    check_size(BRANCH_K, 1000)
