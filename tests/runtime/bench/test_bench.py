"""glance-bench: the law fit on rounds drawn from the law itself, the statistics it rests on, and the
command end to end on the embedded default (ONNX Runtime), auto and its `cost` and `calibrate` commands
included. Deterministic checks only: no timing (auto's sizes depend on the measured costs, so only what
holds for any sizes is checked)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from support import blocking

from glance_runtime.store.atomic import MARKER
from glance_runtime.cli.bench import main as bench_main
from glance_runtime.bench.law import MIN_ROUNDS, analyse, expected_accepted
from glance_runtime.bench.modes import Mode, modes_for, parse_budgets
from glance_runtime.bench.stats import rankdata, spearman
from glance_runtime.decode.calibration import load_calibration
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.errors import GlanceError

REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
KINDS = ("receipt", "caption")
ROUND_FIELDS = {"kind", "prompt", "mode", "sample", "round", "entropy", "accepted", "tree_size", "cap",
                "draft_ms", "verify_ms", "total_ms", "final", "outside_ms", "target_graph_ms", "draft_graph_ms", "vocab_graph_ms",
                "drafted", "surprisal", "node_scores", "node_depths", "path"}
MODE_FIELDS = {"tau", "rounds", "mean_tree_size", "ms_per_token_decode", "ms_per_token_with_prefill", "prefill_ms",
               "identical", "runs", "target_graph_ms", "draft_graph_ms", "vocab_graph_ms", "outside_share"}
SPEC_FIELDS = {"speedup_decode", "speedup_decode_interval", "speedup_with_prefill", "speedup_with_prefill_interval",
               "ideal_speedup", "achieved_fraction"}
LAW_FIELDS = {"b0", "b1", "slope", "b0_interval", "b1_interval", "spearman_rho", "spearman_p", "lr_p", "deciles",
              "decile_r2", "decile_coverage", "verdict", "rounds", "prompts"}


def draw_rounds(b0: float, b1: float, n: int, cap, seed: int):
    """Rounds from the law itself: H ~ gamma, a ~ truncated geometric with logit p = b0 - b1 H."""
    rng = np.random.default_rng(seed)
    h = rng.gamma(2.0, 0.6, n)
    p = 1 / (1 + np.exp(-(b0 - b1 * h)))
    caps = np.broadcast_to(np.asarray(cap), (n,))
    a = np.minimum(rng.geometric(1 - p) - 1, caps)
    return h, a, caps


@pytest.mark.edge
def test_law_fit_recovers_known_coefficients():
    h, a, cap = draw_rounds(2.0, 1.5, 1500, 15, seed=3)
    fit = analyse(h, a, cap, groups=np.arange(len(h)) // 3, replicates=200, permutations=500, seed=0)
    assert fit.converged
    assert abs(fit.b0 - 2.0) < 0.2 and abs(fit.b1 - 1.5) < 0.2
    assert fit.b0_interval[0] < 2.0 < fit.b0_interval[1] and fit.b1_interval[0] < 1.5 < fit.b1_interval[1]
    assert fit.slope < 0 and fit.spearman_rho < -0.3 and fit.spearman_p < 0.01 and fit.lr_p < 1e-6
    assert len(fit.deciles) == 10 and fit.decile_r2 > 0.8 and fit.decile_coverage >= 0.7
    assert fit.verdict.startswith("holds")


@pytest.mark.edge
def test_law_fit_with_per_round_caps_and_no_effect():
    h, a, cap = draw_rounds(1.0, 0.8, 1500, np.resize([3, 7, 15], 1500), seed=4)
    fit = analyse(h, a, cap, replicates=100, permutations=200)
    assert abs(fit.b0 - 1.0) < 0.2 and abs(fit.b1 - 0.8) < 0.2
    h, a, cap = draw_rounds(1.0, 0.0, 800, 15, seed=5)
    flat = analyse(h, a, cap, replicates=200, permutations=500)
    assert flat.b1_interval[0] < 0 < flat.b1_interval[1] and not flat.verdict.startswith("holds")


@pytest.mark.edge
def test_law_refuses_impossible_rounds_and_says_when_entropy_is_constant():
    with pytest.raises(ValueError):
        analyse([0.1, 0.2], [3, 9], [7, 7])
    fit = analyse(np.zeros(40), np.resize([1, 2, 3], 40), np.full(40, 15), replicates=20, permutations=20)
    assert np.isnan(fit.b1) and "barely varies" in fit.verdict


def test_too_few_rounds_are_not_fitted_or_drawn_and_it_says_so(tmp_path):
    """13 rounds of a steep sample once gave b1 in the thousands and an exp overflow: below the rounds the
    law needs nothing is fitted, the verdict says why, and the plot shows the rounds without a curve."""
    h = np.linspace(0.0, 0.02, 13)
    a = np.where(h < 0.01, 15, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = analyse(h, a, np.full(13, 15), replicates=20, permutations=20)
        assert np.isnan(fit.b0) and np.isnan(fit.b1) and fit.deciles == []
        assert fit.verdict == f"not fitted: 13 rounds are too few to fit or test the law (it needs {MIN_ROUNDS})"
        steep = expected_accepted(1.0, 5000.0, np.array([0.0, 1.0]), np.array([15, 15]))
        p = 1 / (1 + np.exp(-1.0))
        assert steep[0] == pytest.approx(sum(p ** k for k in range(1, 16))) and steep[1] == 0.0
        rows = [{"entropy": float(x), "drafted": int(y), "cap": 15} for x, y in zip(h, a)]
        from glance_runtime.bench.plots import plot_law

        plot_law(tmp_path / "law.png", {"pooled": fit}, rows, "tree-15")
    assert (tmp_path / "law.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.edge
def test_expected_accepted_is_the_truncated_geometric_mean():
    # p = 0.5, L = 2: E = 0.5 + 0.25; p -> 1 gives the cap; always within 0..L.
    assert expected_accepted(0.0, 0.0, np.array([1.0]), np.array([2]))[0] == pytest.approx(0.75)
    assert expected_accepted(40.0, 0.0, np.array([0.0]), np.array([15]))[0] == pytest.approx(15)
    values = expected_accepted(1.0, 2.0, np.linspace(0, 5, 50), np.full(50, 7))
    assert np.all((values >= 0) & (values <= 7)) and np.all(np.diff(values) < 0)


@pytest.mark.edge
def test_rank_statistics():
    assert rankdata(np.array([3.0, 1.0, 2.0, 2.0])).tolist() == [4.0, 1.0, 2.5, 2.5]
    rng = np.random.default_rng(0)
    x = np.arange(30, dtype=float)
    rho, p = spearman(x, -x ** 3, 200, rng)
    assert rho == pytest.approx(-1.0) and p < 0.01


@pytest.mark.edge
def test_budgets_and_modes():
    assert parse_budgets("63,7, 15,7") == ([7, 15, 63], False)
    assert parse_budgets("7,AUTO,15") == ([7, 15], True)
    for bad in ("7,x", "", "0,7", "-1", "auto"):
        with pytest.raises(GlanceError, match="--budgets"):
            parse_budgets(bad)
    assert Mode("auto", "auto", 63, 8).cap(16) == 15 and Mode("auto", "auto", 5, 8).config(9).budget == 5
    names = [m.name for m in modes_for([7, 15, 31], 8, 16, chain=True)]
    assert names == ["ar", "tree-7", "tree-15", "tree-31", "chain-7", "chain-15"]
    assert [m.cap(16) for m in modes_for([7, 31], 8, 16, chain=False)] == [0, 7, 15]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The embedded default's graphs, copied without cost profiles: auto measures one and stores it beside
    them, here rather than in the repository's models/."""
    art = tmp_path_factory.mktemp("artifacts") / "glance-vl-tiny-onnx"
    shutil.copytree(DEFAULT_ARTIFACTS, art, ignore=shutil.ignore_patterns("cost-profile-*", ".cost-profile-*"))
    return art


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory, artifacts):
    """One small run on the embedded default: 2 prompts of 2 kinds, budgets 7 and 15, chains and auto too."""
    out = tmp_path_factory.mktemp("bench") / "out"
    data = [str(REPO / "examples" / k / "tasks.jsonl") for k in KINDS]
    argv = ["--data", *data, "--n", "2", "--budgets", "7,15,auto", "--chain", "--samples", "2", "--threads", "1",
            "--bootstrap", "50", "--artifacts", str(artifacts), "--out", str(out),
            "--expect", "identical>=1", "--expect", "tau@receipt>=1", "--expect", "auto_vs_best>0"]
    assert bench_main(argv) == 0
    return out


def test_bench_writes_every_output_with_its_fields(bench_out):
    for name in ("report.json", "report.md", "rounds.jsonl", "law.png", "speedup.png", "verify_cost.png",
                 "auto_sizes.png", "calibration.png"):
        assert (bench_out / name).is_file(), name
    for png in bench_out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((bench_out / "report.json").read_text())
    assert set(report["kinds"]) == set(KINDS)
    assert report["settings"]["modes"] == ["ar", "tree-7", "tree-15", "chain-7", "chain-15", "auto"]
    assert report["settings"]["warmup_dropped"] == 1
    for section in [*report["kinds"].values(), report["pooled"]]:
        assert section["best"] in report["settings"]["modes"][1:]
        for name, entry in section["modes"].items():
            assert {"tau", "rounds", "mean_tree_size", "outside_share"} <= set(entry)
            if name != "ar":
                lo, hi = entry["speedup_decode_interval"]
                assert lo <= entry["speedup_decode"] <= hi and entry["speedup_decode"] > 0
    for entry in report["kinds"]["receipt"]["modes"].values():
        assert MODE_FIELDS <= set(entry) and (entry["kind"] == "ar" or SPEC_FIELDS <= set(entry))
    assert report["kinds"]["receipt"]["modes"]["ar"]["tau"] == 1.0
    assert report["lossless"]["identical"] == report["lossless"]["runs"] > 0
    assert set(report["law"]) == {*KINDS, "pooled"} and LAW_FIELDS <= set(report["law"]["pooled"])
    assert set(report["tree_vs_chain"]["pooled"]) == {"7", "15"}
    assert [(e["expect"], e["met"]) for e in report["expectations"]] == [
        ("identical>=1", True), ("tau@receipt>=1", True), ("auto_vs_best>0", True)]
    assert set(report["expectations"][0]["values"]) == {"pooled"}
    assert set(report["expectations"][1]["values"]) == {"receipt"}
    assert set(report["expectations"][2]["values"]) == {*KINDS, "pooled"}
    md = (bench_out / "report.md").read_text()
    for heading in ("## Speed", "## Tree against chain", "## Loop efficiency", "## The draftability law", "## auto",
                    "## Node calibration", "## Expectations"):
        assert heading in md


def test_round_log_has_one_line_per_round_of_every_kept_run(bench_out):
    rows = [json.loads(line) for line in (bench_out / "rounds.jsonl").read_text().splitlines()]
    report = json.loads((bench_out / "report.json").read_text())
    assert all(ROUND_FIELDS <= set(r) for r in rows)
    assert {r["sample"] for r in rows} == {1}  # sample 0 is the dropped warm-up
    for kind, section in report["kinds"].items():
        for mode, entry in section["modes"].items():
            assert sum(r["kind"] == kind and r["mode"] == mode for r in rows) == entry["rounds"]
    assert all(r["tree_size"] == 1 and r["accepted"] == 1 for r in rows if r["mode"] == "ar")
    assert all(r["tree_size"] <= 8 for r in rows if r["mode"] in ("tree-7", "chain-7"))
    assert all(1 <= r["accepted"] <= r["cap"] + 1 for r in rows)
    # What auto's calibration is fitted to: every verified node's score and depth, and the accepted path.
    assert all(not r["drafted"] and r["node_scores"] == r["path"] == [] for r in rows if r["mode"] == "ar")
    for r in rows:
        assert len(r["node_scores"]) == len(r["node_depths"]) == r["tree_size"] - 1
        # the path and its bonus; an answer's final round that accepts a drafted stop token has no bonus after it
        bonus = (0, 1) if r["final"] else (1,)
        assert all(s <= 0 for s in r["node_scores"]) and r["accepted"] - len(r["path"]) in bonus
        assert all(1 <= i < r["tree_size"] for i in r["path"]) and r["path"] == sorted(r["path"])
        assert [r["node_depths"][i - 1] for i in r["path"]] == list(range(1, len(r["path"]) + 1))
        assert (r["surprisal"] is None) == (r["round"] == 0)
    assert all(r["drafted"] for r in rows if r["mode"].startswith(("tree-", "chain-")))
    assert all(r["tree_size"] == 1 for r in rows if r["mode"] == "auto" and not r["drafted"])
    last = {}
    for r in rows:
        last[(r["kind"], r["prompt"], r["mode"], r["sample"])] = r["round"]
    assert all(r["final"] == (r["round"] == last[(r["kind"], r["prompt"], r["mode"], r["sample"])]) for r in rows)


def test_auto_is_lossless_and_reported(bench_out, artifacts):
    report = json.loads((bench_out / "report.json").read_text())
    rows = [json.loads(line) for line in (bench_out / "rounds.jsonl").read_text().splitlines()]
    auto = report["auto"]
    cap = min(auto["max_nodes"], report["settings"]["block_size"] - 1)
    assert all(r["cap"] == cap for r in rows if r["mode"] == "auto")
    assert all(r["tree_size"] <= auto["max_nodes"] + 1 for r in rows if r["mode"] == "auto")
    for kind, section in report["kinds"].items():
        entry = section["modes"]["auto"]
        assert entry["kind"] == "auto" and entry["identical"] == entry["runs"] > 0 and SPEC_FIELDS <= set(entry)
        sizes = auto["sizes"][kind]
        assert sizes["rounds"] == entry["rounds"] == sizes["no_draft"] + sum(sizes["nodes"].values())
        assert auto["vs_best_fixed"][kind]["best"] in ("tree-7", "tree-15")
        lo, hi = auto["vs_best_fixed"][kind]["interval"]
        assert lo <= auto["vs_best_fixed"][kind]["ratio"] <= hi
    assert auto["largest_tree"] == "tree-15" and set(auto["vs_largest_tree"]) == {*KINDS, "pooled"}
    assert auto["cost_profile"]["path"].startswith(str(artifacts / "cost-profile-"))
    assert auto["cost_profile"]["rows"][0] == 1 and "verify rows" in auto["cost_table"]
    assert auto["calibration"]["path"] in ("prior", str(artifacts / "calibration.json"))
    curve = report["calibration_curve"]
    assert curve["modes"] == ["tree-7", "tree-15"] and curve["nodes"] == sum(b["nodes"] for b in curve["bins"])
    assert all(0 <= b["predicted"] <= 1 and 0 <= b["observed"] <= 1 for b in curve["bins"])


def test_cost_prints_the_stored_profile(bench_out, artifacts, capsys):
    capsys.readouterr()
    assert bench_main(["cost", "--artifacts", str(artifacts), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    stored = json.loads((bench_out / "report.json").read_text())["auto"]["cost_profile"]["path"]
    assert "verify rows" in out and "draft pass" in out and f"stored in {stored}" in out


def test_calibrate_writes_a_calibration_auto_runs_with(bench_out, artifacts, tmp_path, capsys):
    rounds = bench_out / "rounds.jsonl"
    assert bench_main(["calibrate", str(rounds), "--out", str(tmp_path)]) == 2  # a folder of the user's
    assert "no glance command made" in capsys.readouterr().err
    assert bench_main(["calibrate", str(rounds), "--out", str(tmp_path / "calibration.json")]) == 0
    assert "verified nodes" in capsys.readouterr().out
    assert bench_main(["calibrate", str(rounds), "--out", str(tmp_path / "calibration.json")]) == 0  # its own file
    fitted = load_calibration(tmp_path / "calibration.json")
    assert fitted.fitted and fitted.fitted_on["modes"] == ["tree-15", "tree-7"]
    assert bench_main(["calibrate", str(rounds), "--mode", "chain-7", "--out", str(tmp_path / "chain.json")]) == 0
    assert load_calibration(tmp_path / "chain.json").fitted_on["modes"] == ["chain-7"]
    assert bench_main(["calibrate", str(rounds), "--mode", "tree-99"]) == 2
    assert "tree-99" in capsys.readouterr().err
    out = tmp_path / "bench"
    assert bench_main(["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--n", "1", "--budgets", "7,auto",
                       "--samples", "2", "--threads", "1", "--bootstrap", "20", "--no-plots", "--artifacts",
                       str(artifacts), "--calibration", str(tmp_path / "calibration.json"), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["auto"]["calibration"]["path"] == str(tmp_path / "calibration.json")
    assert report["lossless"]["identical"] == report["lossless"]["runs"]


def test_law_runs_alone_on_a_round_log(bench_out, tmp_path, capsys):
    assert bench_main(["law", str(bench_out / "rounds.jsonl"), "--mode", "tree-7", "--bootstrap", "50",
                       "--json", "--out", str(tmp_path / "law")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["mode"] == "tree-7" and LAW_FIELDS <= set(printed["law"]["pooled"])
    assert {p.name for p in (tmp_path / "law").iterdir()} == {MARKER, "law.json", "law.md", "law.png"}
    rows = [json.loads(line) for line in (bench_out / "rounds.jsonl").read_text().splitlines()]
    assert bench_main(["law", str(bench_out / "rounds.jsonl"), "--mode", "tree-7", "--include-final", "--json",
                       "--bootstrap", "20"]) == 0
    counted = json.loads(capsys.readouterr().out)["law"]["pooled"]["rounds"]
    assert counted == sum(r["mode"] == "tree-7" for r in rows) > printed["law"]["pooled"]["rounds"]
    # A log without modes or caps (e.g. glance-run --json's round_log) needs --cap.
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"entropy": 0.1 * i, "accepted": 1 + i % 4}) + "\n" for i in range(30)))
    assert bench_main(["law", str(plain), "--cap", "15", "--bootstrap", "20"]) == 0
    assert "pooled" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--data", "missing/tasks.jsonl", "--out", "OUT"], "task file missing/tasks.jsonl does not exist"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--budgets", "7,x", "--out", "OUT"], "--budgets"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--samples", "1", "--out", "OUT"], "--samples"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--budgets", "500", "--n", "1", "--out", "OUT"],
     "--budget 500"),
    (["law", "missing.jsonl"], "round log missing.jsonl does not exist"),
    (["--data", "EMPTY", "--out", "OUT"], "has no tasks"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--max-new-tokens", "1", "--out", "OUT"],
     "--max-new-tokens must be >= 2"),
    (["--data", "LATIN1", "--out", "OUT"], "is not valid UTF-8"),
    (["law", "LATIN1"], "is not valid UTF-8"),
    (["--data", "EMPTY"], "the following arguments are required: --out"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--budgets", "auto", "--out", "OUT"], "at least one"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--budgets", "7", "--remeasure", "--out", "OUT"],
     "add auto to --budgets"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--calibration", "missing.json", "--out", "OUT"],
     "calibration missing.json does not exist"),
    (["calibrate", "missing.jsonl"], "round log missing.jsonl does not exist"),
    (["calibrate", "OLDLOG"], "rerun glance-bench with this version"),
    (["cost", "--artifacts", "missing"], "--artifacts missing does not exist"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--expect", "speedup=>2", "--out", "OUT"],
     "is not METRIC[@KIND] OP NUMBER"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--expect", "fast>=2", "--out", "OUT"],
     "unknown metric 'fast'"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--expect", "tree_vs_chain>=1.3", "--out", "OUT"],
     "measured only with --chain"),
    (["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--budgets", "7", "--expect", "auto_vs_best<=1.05",
      "--out", "OUT"], "measured only with auto in --budgets"),
])
def test_bad_input_is_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (tmp_path / "old.jsonl").write_text(json.dumps({"mode": "tree-7", "entropy": 0.1, "accepted": 2}) + "\n")
    names = {"OUT": tmp_path / "out", "EMPTY": tmp_path / "empty.jsonl", "LATIN1": tmp_path / "latin1.jsonl",
             "OLDLOG": tmp_path / "old.jsonl"}
    argv = [str(names.get(a, a)) for a in argv]
    try:
        code = bench_main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glance-bench: error:") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.edge
def test_an_unmet_expectation_is_reported_and_exits_1(artifacts, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--data", str(REPO / "examples/receipt/tasks.jsonl"), "--n", "1", "--budgets", "7", "--samples", "2",
            "--threads", "1", "--bootstrap", "10", "--no-plots", "--artifacts", str(artifacts), "--out", str(out),
            "--expect", "speedup>=1000", "--expect", "identical>=1"]
    assert bench_main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("NOT met: speedup>=1000 (receipt ") and lines[-1].startswith("met: identical>=1")
    report = json.loads((out / "report.json").read_text())
    assert [e["met"] for e in report["expectations"]] == [False, True]
    assert "- NOT met: speedup>=1000" in (out / "report.md").read_text()


def test_an_expectation_on_a_kind_the_run_lacks_is_refused(bench_out):
    from glance_runtime.bench.expect import judge_all, parse

    report = json.loads((bench_out / "report.json").read_text())
    with pytest.raises(GlanceError, match="no kind 'chart'"):
        judge_all([parse("speedup@chart>=1", set())], report)
    assert judge_all([parse("identical >= 1", set())], report)[0]["met"]
    assert set(judge_all([parse("law_slope<0", set())], report)[0]["values"]) == {*KINDS, "pooled"}


def test_law_refuses_an_unknown_mode_and_a_missing_cap(bench_out, tmp_path, capsys):
    assert bench_main(["law", str(bench_out / "rounds.jsonl"), "--mode", "tree-99"]) == 2
    assert "tree-99" in capsys.readouterr().err
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"entropy": 0.1, "accepted": 2}) + "\n")
    assert bench_main(["law", str(plain)]) == 2
    assert "--cap" in capsys.readouterr().err


EDGE_BENCH = blocking("torch", "transformers", "glance_export", "safetensors", "matplotlib", "tqdm") + """
from glance_runtime.cli.bench import main
code = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.edge
def test_edge_install_benches_without_torch_and_refuses_plots_in_one_line(tmp_path):
    """No torch, matplotlib or tqdm: the bench measures and fits (one line of progress per prompt);
    plots are refused before any work, with the extra to install."""
    base = [sys.executable, "-c", EDGE_BENCH, "--data", str(REPO / "examples/scene/tasks.jsonl"), "--n", "1",
            "--budgets", "7", "--samples", "2", "--bootstrap", "20", "--threads", "1"]
    run = subprocess.run(base + ["--out", str(tmp_path / "a"), "--no-plots"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "[1/1] scene 0" in run.stderr and "torch imported: False" in run.stderr
    assert {p.name for p in (tmp_path / "a").iterdir()} == {MARKER, "report.json", "report.md", "rounds.jsonl"}
    run = subprocess.run(base + ["--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "pip install 'glance-toolkit[bench]'" in run.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.edge
def test_a_sampled_bench_holds_every_mode_to_plain_sampling(tmp_path):
    """--temperature: every mode samples prompt i with the sampling seed + i, so each run must equal AR's (plain
    sampling); the report records the settings."""
    out = tmp_path / "bench"
    assert bench_main(["--data", str(REPO / "examples/caption/tasks.jsonl"), "--n", "2", "--budgets", "7,15,auto",
                       "--samples", "2", "--threads", "1", "--bootstrap", "20", "--no-plots", "--temperature", "1.2",
                       "--top-p", "0.95", "--sampling-seed", "9", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["sampling"] == {"temperature": 1.2, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "seed": 9}
    assert report["lossless"]["identical"] == report["lossless"]["runs"] > 0
    assert bench_main(["--data", str(REPO / "examples/caption/tasks.jsonl"), "--out", str(tmp_path / "bad"),
                       "--temperature", "1.0", "--min-p", "1.5"]) == 2
