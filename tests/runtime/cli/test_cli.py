"""The commands end to end on tiny snapshots: outputs, exit codes and one-line errors."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from glance_export.cli import main as export_main
from glance_runtime.cli.bench import main as bench_main
from glance_runtime.decode.calibration import FILE as CALIBRATION, Calibration
from glance_runtime.cli.run import main as run_main
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.session import Settings


@pytest.fixture(scope="module")
def head_dir(snapshot_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "head"
    assert export_main(["init-head", "--model", str(snapshot_dir("qwen2_5_vl")), "--out", str(out),
                        "--block-size", "8", "--seed", "1"]) == 0
    return out


def test_init_head_writes_a_loadable_head(head_dir):
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["target_layer_ids"] == [2]


def test_run_json_spec_equals_no_spec(snapshot_dir, images, head_dir, capsys):
    base = ["--backend", "torch", "--model", str(snapshot_dir("qwen2_5_vl")), "--image", str(images["wide"]),
            "--prompt", "What colour is the square?", "--max-new-tokens", "12", "--json"]
    assert run_main(base + ["--head", str(head_dir), "--budget", "31"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert run_main(base + ["--no-spec"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert {"text", "tokens", "tau", "rounds", "ms_per_token", "backend"} <= set(spec)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["backend"] == "torch" and spec["tokens"] == 12 and plain["tau"] == 1.0
    assert len(spec["round_log"]) == spec["rounds"]
    produced = 1  # the prefill's token
    for r in spec["round_log"]:  # a tree holds what the tokens left can use: depth 1 keeps the 8 best, none a plain step
        left = 12 - produced
        assert r["tree_size"] == (32 if left >= 3 else 9 if left == 2 else 1), (left, r)
        produced += r["accepted"]
    assert produced == spec["tokens"]


def test_run_streams_text_and_prints_stats(snapshot_dir, head_dir, capsys):
    assert run_main(["--backend", "torch", "--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head_dir),
                     "--prompt", "Hello",
                     "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert out.out.endswith("\n") and "tau" in out.err and "tok/s" in out.err


def test_audit_reports_parity(snapshot_dir, images, head_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"image": str(images["tall"]), "prompt": "What is shown?"}) + "\n"
                     + json.dumps({"prompt": "Describe nothing."}) + "\n")
    code = export_main(["audit", "--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head_dir),
                        "--data", str(tasks), "--max-new-tokens", "10", "--budget", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["n"] == 2 and report["identical"] == 2 and report["self_consistent"] == 2
    assert report["first_divergence"] == [None, None] and report["tau"] >= 1.0


def test_audit_budget_auto_is_recorded_and_63_stays_the_default(snapshot_dir, images, head_dir, tmp_path,
                                                               monkeypatch, capsys):
    """auto is an audit on request (its profile measured into the cache: the torch reference has no export
    directory); without --budget the audit checks the fixed trees of 63 nodes, measuring nothing."""
    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path / "cache"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"image": str(images["tall"]), "prompt": "What is shown?"}) + "\n"
                     + json.dumps({"prompt": "Describe nothing."}) + "\n")
    common = ["audit", "--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head_dir), "--data", str(tasks),
              "--max-new-tokens", "10", "--json"]
    assert export_main(common) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["budget"] == 63 and "measuring" not in out.err
    assert not (tmp_path / "cache" / "cost").exists()
    code = export_main(common + ["--budget", "auto"])
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert code == 0 and report["budget"] == "auto" and report["identical"] == report["n"] == 2 and report["passed"]
    assert "measuring round costs" in out.err and len(list((tmp_path / "cache" / "cost").glob("*.json"))) == 1


def test_run_budget_auto_logs_skipped_drafts_and_becomes_the_default(snapshot_dir, head_dir, tmp_path, monkeypatch,
                                                                      capsys):
    """On torch the default is 63 until a profile exists. With --budget auto and a calibration beside the head
    whose law says drafts are never accepted (whatever the anchor), every round, the first included, is a plain
    greedy step or, while the fresh cost profile is unchecked, a probe verifying the anchor and one node:
    lossless, and the JSON round log says so."""
    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path / "cache"))
    head = Path(shutil.copytree(head_dir, tmp_path / "head"))
    Calibration(law=(-20.0, 0.0)).save(head / CALIBRATION)
    base = ["--backend", "torch", "--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head),
            "--prompt", "What colour is the square?", "--max-new-tokens", "10", "--json"]
    assert run_main(base) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["budget"] == 63 and not (tmp_path / "cache" / "cost").exists()
    assert run_main(base + ["--budget", "auto"]) == 0
    auto = json.loads(capsys.readouterr().out)
    log = auto["round_log"]
    assert auto["budget"] == "auto" and auto["token_ids"] == fixed["token_ids"] and len(log) == auto["rounds"] > 2
    plain = [r for r in log if not r["drafted"]]
    assert all(r["tree_size"] == 1 and r["accepted"] == 1 for r in plain)
    assert all(r["tree_size"] <= 2 for r in log) and len(log) - len(plain) <= len(plain) + 1  # probe every other
    assert run_main(base) == 0
    assert json.loads(capsys.readouterr().out)["budget"] == "auto", "a stored profile makes auto the default"
    assert run_main(base + ["--budget", "15"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"] == 15


def _one_line_error(capsys, code):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "error:" in err[0] and "Traceback" not in err[0]
    return err[0]


def test_errors_are_one_line(snapshot_dir, head_dir, tmp_path, capsys):
    model = str(snapshot_dir("qwen2_5_vl"))
    line = _one_line_error(capsys, run_main(["--model", model, "--head", str(head_dir), "--prompt", "x",
                                             "--image", str(tmp_path / "missing.png")]))
    assert "missing.png does not exist" in line
    line = _one_line_error(capsys, run_main(["--model", model, "--prompt", "x"]))
    assert "--head" in line
    line = _one_line_error(capsys, export_main(["audit", "--model", model, "--head", str(head_dir),
                                                "--data", str(tmp_path / "none.jsonl")]))
    assert "none.jsonl does not exist" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    line = _one_line_error(capsys, export_main(["audit", "--model", model, "--head", str(head_dir),
                                                "--data", str(bad)]))
    assert "bad.jsonl:2" in line
    (tmp_path / "empty").mkdir()
    line = _one_line_error(capsys, export_main(["init-head", "--model", str(tmp_path / "empty"), "--out",
                                                str(tmp_path / "h")]))
    assert "config.json is missing" in line
    assert not (tmp_path / "h").exists()


def test_empty_task_file_fails_the_audit(snapshot_dir, head_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code = export_main(["audit", "--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head_dir),
                        "--data", str(empty)])
    assert "empty.jsonl has no tasks" in _one_line_error(capsys, code)  # refused, never a vacuous PASS


@pytest.fixture(scope="module")
def artifacts(snapshot_dir, head_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_onnx") / "art"
    assert export_main(["onnx", "--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head_dir),
                        "--out", str(out), "--max-context", "256", "--max-tree", "32", "--quiet"]) == 0
    return out


def test_onnxruntime_run_matches_torch(snapshot_dir, images, head_dir, artifacts, capsys):
    common = ["--image", str(images["tall"]), "--prompt", "What colour is the square?", "--max-new-tokens", "10",
              "--json", "--budget", "31"]
    assert run_main(["--backend", "onnxruntime", "--artifacts", str(artifacts)] + common) == 0
    ort = json.loads(capsys.readouterr().out)
    assert run_main(["--backend", "torch", "--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head_dir)]
                    + common) == 0
    torch_run = json.loads(capsys.readouterr().out)
    assert ort["backend"] == "onnxruntime" and ort["token_ids"] == torch_run["token_ids"]


def test_onnxruntime_audit_against_the_torch_oracle(snapshot_dir, images, artifacts, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"image": str(images["wide"]), "prompt": "What is shown?"}) + "\n")
    code = export_main(["audit", "--backend", "onnxruntime", "--artifacts", str(artifacts), "--model",
                        str(snapshot_dir("qwen2_5_vl")), "--data", str(tasks), "--max-new-tokens", "8", "--budget", "31",
                        "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["backend"] == "onnxruntime" and report["identical"] == report["n"] == 1
    other = str(snapshot_dir("qwen3"))
    capsys.readouterr()
    line = _one_line_error(capsys, export_main(["audit", "--backend", "onnxruntime", "--artifacts", str(artifacts),
                                                "--model", other, "--data", str(tasks), "--budget", "31"]))
    assert "re-export" in line


def test_onnxruntime_defaults_to_auto_measured_once_beside_the_artifacts(artifacts, images, tmp_path, capsys):
    """Exported graphs run auto by default: the first run measures and stores the profile, later runs reuse it."""
    copy = Path(shutil.copytree(artifacts, tmp_path / "art"))
    args = ["--backend", "onnxruntime", "--artifacts", str(copy), "--image", str(images["tall"]), "--prompt",
            "What colour is the square?", "--max-new-tokens", "10", "--json"]
    assert run_main(args) == 0
    first = capsys.readouterr()
    auto = json.loads(first.out)
    assert auto["budget"] == "auto" and "measuring round costs" in first.err
    assert len(list(copy.glob("cost-profile-*.json"))) == 1 and all("drafted" in r for r in auto["round_log"])
    assert run_main(args) == 0
    second = capsys.readouterr()
    assert "measuring" not in second.err and json.loads(second.out)["token_ids"] == auto["token_ids"]
    assert run_main(args + ["--budget", "31"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["budget"] == 31 and fixed["token_ids"] == auto["token_ids"]


def test_onnxruntime_audit_with_auto(snapshot_dir, images, artifacts, tmp_path, capsys):
    copy = Path(shutil.copytree(artifacts, tmp_path / "art"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"image": str(images["wide"]), "prompt": "What is shown?"}) + "\n"
                     + json.dumps({"prompt": "Describe nothing."}) + "\n")
    code = export_main(["audit", "--backend", "onnxruntime", "--artifacts", str(copy), "--model",
                        str(snapshot_dir("qwen2_5_vl")), "--data", str(tasks), "--max-new-tokens", "12",
                        "--budget", "auto", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["budget"] == "auto" and report["identical"] == report["n"] == 2
    assert len(list(copy.glob("cost-profile-*.json"))) == 1


def test_onnxruntime_without_artifacts_exports_once_into_the_cache(snapshot_dir, head_dir, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("GLANCE_CACHE", str(tmp_path / "cache"))
    args = ["--backend", "onnxruntime", "--model", str(snapshot_dir("qwen3")), "--head", str(head_dir),
            "--prompt", "Hello", "--max-new-tokens", "4", "--json"]
    code = export_main(["init-head", "--model", str(snapshot_dir("qwen3")), "--out", str(tmp_path / "h3"),
                        "--block-size", "4"])
    args[args.index(str(head_dir))] = str(tmp_path / "h3")
    capsys.readouterr()
    assert code == 0 and run_main(args) == 0
    first = capsys.readouterr()
    entries = [p for p in (tmp_path / "cache" / "onnx").iterdir() if p.is_dir()]  # beside each: its lock file
    assert "exporting" in first.err and len(entries) == 1
    assert run_main(args) == 0
    second = capsys.readouterr()
    assert "exporting" not in second.err
    assert json.loads(second.out)["token_ids"] == json.loads(first.out)["token_ids"]


def test_onnxruntime_needs_artifacts_or_model_and_head(snapshot_dir, capsys):
    line = _one_line_error(capsys, run_main(["--backend", "onnxruntime", "--model", str(snapshot_dir("qwen2")),
                                             "--prompt", "x"]))
    assert "--artifacts" in line


def test_backend_defaults_to_onnxruntime_when_a_head_is_given(snapshot_dir, head_dir, capsys):
    assert run_main(["--model", str(snapshot_dir("qwen2_5_vl")), "--head", str(head_dir), "--prompt", "Hi",
                     "--max-new-tokens", "3", "--budget", "15", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "onnxruntime"


@pytest.mark.edge
def test_missing_default_model_is_a_clear_error(tmp_path, monkeypatch, capsys):
    import glance_runtime.defaults as defaults

    monkeypatch.setattr(defaults, "DEFAULT_MODEL", tmp_path / "glance-vl-tiny")
    line = _one_line_error(capsys, run_main(["--prompt", "What is the total?"]))
    assert "embedded default model is missing" in line and "--model" in line


def test_eval_scores_each_kind_with_a_blank_control(snapshot_dir, tmp_path, capsys):
    from glance_export.train import corpus

    tasks = corpus.write_task_file(tmp_path / "chart", "chart", 2)
    assert export_main(["eval", "--model", str(snapshot_dir("qwen2_5_vl")), "--data", str(tasks)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{tasks}: chart exact match ") and line.endswith("%)") and "of 2 (blank image" in line
    line = _one_line_error(capsys, export_main(["eval", "--model", str(snapshot_dir("qwen3")), "--data", str(tasks)]))
    assert "qwen3" in line
    line = _one_line_error(capsys, export_main(["eval", "--model", str(snapshot_dir("qwen2_5_vl")), "--data",
                                                str(tmp_path / "none.jsonl")]))
    assert "does not exist" in line


def test_bad_training_mix_is_a_clear_error(tmp_path, capsys):
    for mix in (["scene=lots"], ["posters=1"], ["scene=0"]):
        line = _one_line_error(capsys, export_main(["train-target", "--out", str(tmp_path / "t"), "--mix", *mix]))
        assert "--mix" in line
    assert not (tmp_path / "t").exists()


COMMAND_LINES = {"glance-run": (run_main, ["--prompt", "x"]),
                 "glance-bench": (bench_main, ["--data", "tasks.jsonl", "--out", "out"]),
                 "glance-export audit": (export_main, ["audit", "--data", "tasks.jsonl"])}


@pytest.mark.parametrize("flag, value, phrase", [
    ("--branch-k", "0", "--branch-k must be >= 1 (got 0)"),
    ("--branch-k", "2.5", "--branch-k '2.5' is not a whole number"),
    ("--threads", "0", "--threads 0 is outside 1.."),
    ("--threads", str((os.cpu_count() or 1) + 1), f"the CPUs of this machine; pass --threads 1..{os.cpu_count()}"),
    ("--threads", "nan", "--threads 'nan' is not a whole number"),
    ("--max-tree", "inf", "--max-tree 'inf' is not a whole number"),
    ("--max-context", "-inf", "--max-context '-inf' is not a whole number"),
])
@pytest.mark.edge
def test_a_flag_is_refused_in_the_same_words_by_every_command(flag, value, phrase, capsys):
    """Each flag's rule is stated once: the three commands that take it refuse a bad value identically,
    before opening anything."""
    lines = []
    for prog, (main, argv) in COMMAND_LINES.items():
        with pytest.raises(SystemExit) as stop:
            main(argv + [f"{flag}={value}"])  # the = form: argparse reads a bare "-inf" as an option
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
        lines.append(err[0].removeprefix(f"{prog}: error: ").split("; see ")[0])
    assert phrase in lines[0] and len(set(lines)) == 1, lines


@pytest.mark.edge
def test_budget_and_max_new_tokens_rules_hold_where_declared(capsys):
    for main, argv in (COMMAND_LINES["glance-run"], COMMAND_LINES["glance-export audit"]):
        for flag, value, phrase in (("--budget", "-1", "--budget >= 0"), ("--budget", "nan", "not a budget"),
                                    ("--max-new-tokens", "0", "--max-new-tokens must be >= 1")):
            with pytest.raises(SystemExit):
                main(argv + [flag, value])
            assert phrase in capsys.readouterr().err


@pytest.mark.edge
def test_a_session_decodes_the_backends_own_greedy_tokens():
    """open_session + decode on the shipped graphs: GLANCE's tokens are the backend's own greedy ones, each
    round is seen by on_commit, and the settings are the ones asked for."""
    settings = Settings(budget=15, max_new_tokens=12)
    session = open_session(Source(backend="onnxruntime", artifacts=DEFAULT_ARTIFACTS, threads=1), settings)
    try:
        committed: list[int] = []
        prompt = session.prompt("What is shown?")
        result = session.decode(prompt, lambda new, _reports: committed.extend(new))
        assert committed == result.tokens == session.greedy(prompt) and session.detokenize(result.tokens)
        assert session.config.budget == 15 and session.config.auto is None
    finally:
        session.close()
        session.close()  # idempotent
