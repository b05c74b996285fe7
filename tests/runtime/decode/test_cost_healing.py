"""A stored cost profile that a noisy moment poisoned heals from the decode's own rounds, on the demo itself:
the embedded default's graphs on real ONNX Runtime sessions, run through glance-run as a user would.

The poison is what a busy machine wrote once: every tree of 2 or more rows timed at 3x its rows' worth of
one row (2 rows at 6x one row), so auto never drafts. The checks hold for any timing of this machine that is
not itself 3x off between a 1-row and a 2-row verify."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from glance_runtime.cli.bench import main as bench_main
from glance_runtime.cli.run import main as run_main
from glance_runtime.decode.auto_budget import AutoBudget
from glance_runtime.decode.calibration import load_calibration
from glance_runtime.decode.cost_profile import load, save
from glance_runtime.defaults import DEFAULT_ARTIFACTS

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too
REPO = Path(__file__).resolve().parents[3]
DEMO = ["--image", str(REPO / "examples/demo/receipt.png"), "--prompt", "What is the total?", "--threads", "1"]


@pytest.fixture
def artifacts(tmp_path) -> Path:
    """The default's graphs in a writable copy, with the profile glance-run measures on first use."""
    copy = tmp_path / "art"
    shutil.copytree(DEFAULT_ARTIFACTS, copy, ignore=shutil.ignore_patterns("cost-profile-*", ".cost-profile-*"))
    assert run_main(["--artifacts", str(copy), *DEMO, "--json"]) == 0
    return copy


def _profile_path(artifacts: Path) -> Path:
    (path,) = artifacts.glob("cost-profile-*.json")
    return path


def _poison(artifacts: Path):
    path = _profile_path(artifacts)
    good = load(path)
    one = good.verify_ms[0]
    poisoned = replace(good, verify_ms=(one, *(3 * r * one for r in good.rows[1:])), checked_rows=())
    save(poisoned, path)
    return poisoned


def _run(artifacts: Path, capsys, *extra: str) -> tuple[dict, str]:
    """glance-run's JSON answer and what it said on stderr."""
    capsys.readouterr()
    assert run_main(["--artifacts", str(artifacts), *DEMO, "--json", *extra]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_a_poisoned_profile_speculates_again_by_the_third_run(artifacts, capsys):
    poisoned = _poison(artifacts)
    calibration = load_calibration(artifacts / "calibration.json")
    assert not AutoBudget(poisoned, calibration, 63, 16).should_draft(None)  # uncorrected, auto never drafts

    capsys.readouterr()
    assert bench_main(["cost", "--artifacts", str(artifacts), "--threads", "1"]) == 0
    assert "implausible: a 2-row verify timed at 6.0x one row" in capsys.readouterr().out

    runs, said = zip(*(_run(artifacts, capsys) for _ in range(3)))
    assert runs[2]["tau"] > 1, (said, [r["round_log"] for r in runs], load(_profile_path(artifacts)))
    assert all(r["token_ids"] == runs[0]["token_ids"] for r in runs)  # only the time changes
    healed = load(_profile_path(artifacts))
    assert healed.doubts() == [] and healed.verify_ms[1] < poisoned.verify_ms[1] / 2


def test_remeasure_replaces_a_stored_profile(artifacts, capsys):
    _poison(artifacts)
    assert "measuring round costs" in _run(artifacts, capsys, "--remeasure")[1]
    assert load(_profile_path(artifacts)).doubts() == []
    assert run_main(["--artifacts", str(artifacts), *DEMO, "--remeasure", "--no-spec"]) == 2
    assert "--remeasure" in capsys.readouterr().err
