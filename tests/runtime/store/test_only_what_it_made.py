"""A directory replaced whole holds nothing its maker did not write, or it is not replaced: a user's held-out
data, images or notes put into a head or export directory survive every later run into it. Files the runtime
keeps beside an output (measured costs, a calibration, their empty locks) go with it."""
from __future__ import annotations

import json
import os
import time

import pytest

from glance_runtime.cli.bench import main as bench_main
from glance_runtime.errors import GlanceError
from glance_runtime.store.atomic import MARKER, atomic_directory, check_output, foreign_entries
from support import tree

pytestmark = pytest.mark.edge

FMT, MADE_BY = "glance-test-output", "glance-test"


def _made(out, names=("weights.bin", "config.json")):
    with atomic_directory(out, FMT, MADE_BY) as tmp:
        for name in names:
            (tmp / name).write_text(name)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "part.bin").write_bytes(b"\0")
    return out


@pytest.mark.parametrize("plant", ["file", "folder", "hidden file"])
def test_an_entry_its_maker_did_not_write_stops_the_replacement(tmp_path, plant):
    out = _made(tmp_path / "out")
    name = {"file": "heldout.jsonl", "folder": "imgs", "hidden file": ".notes"}[plant]
    if plant == "folder":
        (out / name).mkdir()
        (out / name / "a.png").write_bytes(b"\x89PNG")
    else:
        (out / name).write_text("a user's rows\n")
    before = tree(tmp_path)
    with pytest.raises(GlanceError, match=f"holds {name}.*move it out"):
        check_output(out, FMT)
    with pytest.raises(GlanceError, match=name):
        with atomic_directory(out, FMT, MADE_BY) as tmp:
            (tmp / "weights.bin").write_text("new")
    assert tree(tmp_path) == before


def test_its_own_entries_and_the_runtimes_companions_are_replaced(tmp_path):
    out = _made(tmp_path / "out")
    (out / "cost-profile-0123456789ab.json").write_text(json.dumps({"format": "glance-cost", "version": 1}))
    (out / ".cost-profile-0123456789ab.json.lock").write_bytes(b"")
    (out / "calibration.json").write_text(json.dumps({"format": "glance-calibration"}))
    _made(out / "engines")  # an output made inside this one (engines built in their bundle)
    assert foreign_entries(out) == []
    _made(out, names=("weights.bin",))
    assert sorted(os.listdir(out)) == sorted([MARKER, "sub", "weights.bin"])
    assert json.loads((out / MARKER).read_text())["entries"] == ["sub", "weights.bin"]


def test_a_file_that_only_looks_like_a_companion_is_kept(tmp_path):
    out = _made(tmp_path / "out")
    (out / ".work.lock").write_text("not empty: someone's\n")
    (out / "cost-profile-0123456789ab.json").write_text(json.dumps({"format": "not-ours"}))
    assert foreign_entries(out) == [".work.lock", "cost-profile-0123456789ab.json"]


def test_an_entry_arriving_while_the_command_runs_stops_the_swap(tmp_path):
    out = _made(tmp_path / "out")
    with pytest.raises(GlanceError, match="notes.txt.*run the same command again"):
        with atomic_directory(out, FMT, MADE_BY) as tmp:
            (tmp / "weights.bin").write_text("new")
            (out / "notes.txt").write_text("written meanwhile\n")
    assert (out / "weights.bin").read_text() == "weights.bin" and (out / "notes.txt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no sibling left behind


def test_a_marker_from_before_entries_were_listed_keeps_what_came_later(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "weights.bin").write_text("old")
    past = time.time() - 60
    os.utime(out / "weights.bin", (past, past))
    (out / MARKER).write_text(json.dumps({"format": FMT, "made_by": MADE_BY}) + "\n")
    os.utime(out / MARKER, (past + 1, past + 1))
    assert foreign_entries(out) == []
    (out / "heldout.jsonl").write_text("{}\n")
    assert foreign_entries(out) == ["heldout.jsonl"]


def test_a_folder_filled_file_by_file_keeps_what_a_user_added(tmp_path, capsys):
    """glance-bench writes its report files into its folder; a user's notes there do not stop a rerun."""
    rounds = tmp_path / "rounds.jsonl"
    rounds.write_text("".join(json.dumps({"mode": "tree-7", "entropy": h / 4, "accepted": 8 - h}) + "\n"
                              for h in range(8)))
    out = tmp_path / "law"
    argv = ["law", str(rounds), "--cap", "15", "--bootstrap", "2", "--no-plots", "--out", str(out)]
    assert bench_main(argv) == 0, capsys.readouterr().err
    (out / "notes.md").write_text("mine\n")
    assert bench_main(argv) == 0
    assert (out / "notes.md").read_text() == "mine\n"


def test_calibrate_writes_into_no_folder_it_was_not_given_by_name(tmp_path, capsys):
    rounds = tmp_path / "in" / "rounds.jsonl"
    rounds.parent.mkdir()
    rounds.write_text(json.dumps({"mode": "tree-7", "entropy": 0.5, "accepted": 1}) + "\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's folder\n")
    before = tree(tmp_path)
    assert bench_main(["calibrate", str(rounds), "--out", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no glance command made" in err[0] and str(mine / "calibration.json") in err[0]
    assert tree(tmp_path) == before
