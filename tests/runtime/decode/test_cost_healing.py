"""A cost profile that a busy machine wrote is learned past from the decode's own rounds, on the demo itself: the
embedded default's graphs on real ONNX Runtime sessions, run through glance-run as a user would.

The checks hold for any timing of this machine that is not itself several times off between a one-row verify and
a tree of a few dozen rows (the poisons below are 5-60x off): they assert tokens, bounds and recovery, never a
choice made from a timing taken during the test."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from glance_runtime.cli.bench import main as bench_main
from glance_runtime.cli.run import main as run_main
from glance_runtime.decode.auto_budget import AutoBudget
from glance_runtime.decode.calibration import load_calibration
from glance_runtime.decode.cost_profile import load, save
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.formats.cost import REMEDY

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too
REPO = Path(__file__).resolve().parents[3]
DEMO = ["--image", str(REPO / "examples/demo/receipt.png"), "--prompt", "What is the total?", "--threads", "1"]
BURNERS = 4


def _copy(tmp_path: Path) -> Path:
    """The default's graphs in a writable copy, without a cost profile."""
    copy = tmp_path / "art"
    shutil.copytree(DEFAULT_ARTIFACTS, copy, ignore=shutil.ignore_patterns("cost-profile-*", ".cost-profile-*"))
    return copy


@pytest.fixture
def artifacts(tmp_path) -> Path:
    """A writable copy with the profile glance-run measures on first use."""
    copy = _copy(tmp_path)
    assert run_main(["--artifacts", str(copy), *DEMO, "--json"]) == 0
    return copy


def _profile_path(artifacts: Path) -> Path:
    (path,) = artifacts.glob("cost-profile-*.json")
    return path


def _run(artifacts: Path, capsys, *extra: str) -> tuple[dict, str]:
    """glance-run's JSON answer and what it said on stderr."""
    capsys.readouterr()
    assert run_main(["--artifacts", str(artifacts), *DEMO, "--json", *extra]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def _greedy(artifacts: Path, capsys) -> list[int]:
    return _run(artifacts, capsys, "--no-spec")[0]["token_ids"]


# What busy machines wrote, as multiples of the one-row cost (the draft pass at one row's cost): cheap 1-2 rows
# with 4+ rows 5-60x one row (not monotone: 32 rows timed cheaper than 16), already checked at 1 and 2 rows by
# an earlier decode; and every tree of 2 or more rows at 3x its rows' worth of one row (2 rows at 6x).
POISONS = {"busy": ((1.0, 1.13, 5.0, 8.1, 29.6, 14.4, 63.7), (1, 2)),
           "dear": ((1.0, 6.0, 12.0, 24.0, 48.0, 96.0, 192.0), ())}


@pytest.mark.parametrize("poison", POISONS)
def test_a_poisoned_profile_gives_the_demo_tau_3_again_by_the_third_run(artifacts, poison, capsys):
    good = load(_profile_path(artifacts))
    times, checked = POISONS[poison]
    one = good.verify_ms[0]
    poisoned = replace(good, verify_ms=tuple(one * t for t in times), draft_ms=one, checked_rows=checked)
    save(poisoned, _profile_path(artifacts))
    calibration = load_calibration(artifacts / "calibration.json")
    assert not AutoBudget(poisoned, calibration, 63, 16).should_draft(None)  # as stored, auto never drafts

    capsys.readouterr()
    assert bench_main(["cost", "--artifacts", str(artifacts), "--threads", "1"]) == 0
    said = capsys.readouterr().out
    assert ("doubtful: 32 rows timed at" if poison == "busy" else "doubtful: a 2-row verify timed at 6.0x") in said
    assert REMEDY in said.splitlines()

    greedy = _greedy(artifacts, capsys)
    runs, said = zip(*(_run(artifacts, capsys) for _ in range(3)))
    assert all(r["token_ids"] == greedy for r in runs)  # only the time changes
    assert runs[2]["tau"] >= 3, (said, [r["round_log"] for r in runs], load(_profile_path(artifacts)))
    learned = load(_profile_path(artifacts))
    assert learned.verify_ms[2] < poisoned.verify_ms[2] / 2 and not learned.disorder()


def test_a_draft_confirmed_too_dear_drafts_again_by_the_third_run(artifacts, capsys):
    """This machine's own verify costs, every count checked, and the draft confirmed at 8 one-row verifies (what two
    drafted rounds slowed alike by other processes can store): as stored, auto never drafts, and nothing is
    unconfirmed to explore; a run that has not timed the draft itself drafts once to time it, and drafts on."""
    good = load(_profile_path(artifacts))
    poisoned = replace(good, draft_ms=8 * good.verify_ms[0], checked_rows=good.rows, draft_checked=True)
    save(poisoned, _profile_path(artifacts))
    calibration = load_calibration(artifacts / "calibration.json")
    assert not AutoBudget(poisoned, calibration, 63, 16).should_draft(None)

    greedy = _greedy(artifacts, capsys)
    runs, said = zip(*(_run(artifacts, capsys) for _ in range(3)))
    assert all(r["token_ids"] == greedy for r in runs)
    assert runs[2]["tau"] >= 3, (said, [r["round_log"] for r in runs], load(_profile_path(artifacts)))
    learned = load(_profile_path(artifacts))
    assert learned.draft_ms < poisoned.draft_ms / 2 and learned.draft_checked


def test_remeasure_replaces_a_stored_profile(artifacts, capsys):
    path = _profile_path(artifacts)
    good = load(path)
    save(replace(good, verify_ms=(good.verify_ms[0], *(3 * r * good.verify_ms[0] for r in good.rows[1:]))), path)
    assert "measuring round costs" in _run(artifacts, capsys, "--remeasure")[1]
    assert load(path).doubts() == []
    assert run_main(["--artifacts", str(artifacts), *DEMO, "--remeasure", "--no-spec"]) == 2
    assert "--remeasure" in capsys.readouterr().err


def _burners(count: int) -> list[subprocess.Popen]:
    """Processes that keep a CPU core busy each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def test_a_first_use_on_a_busy_machine_gives_tau_3_by_the_third_quiet_run(tmp_path, capsys):
    """The profile is measured and first used while 4 processes burn CPU beside it, then the machine is quiet:
    whatever the busy measurement wrote (provisional or not), the third quiet run decodes at tau 3 or more."""
    copy = _copy(tmp_path)
    burners = _burners(BURNERS)
    try:
        busy, said = _run(copy, capsys)
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()
    assert "measuring round costs" in said
    measured = load(_profile_path(copy))
    assert measured is not None and measured.repeats >= 3 and len(measured.spread) == len(measured.rows)
    runs, said = zip(*(_run(copy, capsys) for _ in range(3)))
    assert all(r["token_ids"] == busy["token_ids"] for r in runs)
    assert runs[2]["tau"] >= 3, (said, [r["round_log"] for r in runs], measured, load(_profile_path(copy)))


@pytest.mark.parametrize("where", ["lock", "profile"])
def test_a_directory_where_the_profile_belongs_decodes_with_one_in_memory(tmp_path, where, monkeypatch, capsys):
    """A directory where the profile's lock (beside the artifacts) or the profile itself (in the cache, where
    the place beside the artifacts is taken too) belongs: auto measures, decodes and says once that the profile
    is kept in memory; the answer is greedy's."""
    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path / "cache"))
    copy = _copy(tmp_path)
    greedy = _greedy(copy, capsys)
    assert run_main(["--artifacts", str(copy), *DEMO, "--json"]) == 0
    beside = _profile_path(copy)
    beside.unlink()
    if where == "lock":
        lock = beside.with_name(f".{beside.name}.lock")
        lock.unlink(missing_ok=True)
        lock.mkdir()
    else:
        beside.mkdir()  # taken: the profile goes to the cache, where a directory sits too
        _run(copy, capsys)
        (cached,) = (tmp_path / "cache" / "cost").glob("*.json")
        cached.unlink()
        cached.mkdir()
    for _ in range(2):
        answer, said = _run(copy, capsys)
        assert answer["token_ids"] == greedy and answer["budget"] == "auto"
        assert said.count("cost profile kept in memory for this run only") == 1 and "is a directory" in said
