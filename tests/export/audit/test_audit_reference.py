"""Parity on a device without torch: `glance-export audit --save-reference` records the fp32 PyTorch greedy
tokens and top-2 margins on a workstation; `--reference` audits ONNX Runtime against them, torch-free.

The divergence case is built, not hoped for: in a tiny Qwen2.5-VL, LM-head row B is made a copy of row A
scaled by 1 + 2^-14, with A's row already rounded to fp16. In fp32, B beats A wherever A was the greedy
choice (by a margin far above fp32 noise, far below fp16 resolution); in fp16 the two rows are the same
numbers, the logits tie and the lower id, A, wins. So the fp16 export leaves the fp32 reference at a known
token with a known, tiny margin, in GLANCE and in its own greedy decode alike.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from glance_export.model.adapters import Snapshot
from glance_export.cli import main as export_main
from glance_export.model.head import head_config_for, init_head, pick_mask_token, save_head
from glance_export.onnx import export_artifacts
from glance_export.model.torch_backend import greedy_reference, greedy_with_margins
from glance_export.audit.reference_match import ids_sha256, write_reference
from glance_runtime.formats.recorded_reference import read as load_reference
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.formats.artifacts import read as load_manifest
from support import BLOCK_EXPORT_STACK, make_image, make_snapshot

MAX_NEW = 12
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TASKS = [("What is shown?", "wide"), ("Describe nothing.", None), ("Which colour is largest?", "tall")]


@dataclass(frozen=True)
class NearTie:
    model: Path
    head: Path
    tasks: Path
    fp32: Path
    fp16: Path
    reference: Path
    a: int  # the token fp16 keeps
    b: int  # its fp32 winner, a hair above it
    at: int  # where prompt 1 first meets the tie


def _write_tasks(path: Path, rows: list[tuple[str, Path | None]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, **({"image": str(i)} if i else {})}) + "\n" for p, i in rows))
    return path


def _greedy(model_dir: Path, tasks: list[tuple[str, Path | None]]) -> list[list[int]]:
    snap = Snapshot(model_dir)
    model = snap.load_model("float32")
    return [greedy_reference(model, snap, snap.build_prompt(p, i), MAX_NEW, snap.stop_token_ids) for p, i in tasks]


def _plant_tie(model_dir: Path, a: int, b: int) -> None:
    weights = load_file(model_dir / "model.safetensors")
    head = weights["lm_head.weight"]
    row = head[a].half().float()
    head[a], head[b] = row, row * (1 + 2 ** -14)
    assert torch.equal(head[a].half(), head[b].half()) and not torch.equal(head[a], head[b])
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def near_tie(tmp_path_factory) -> NearTie:
    root = tmp_path_factory.mktemp("near_tie")
    model = make_snapshot(root / "model", "qwen2_5_vl", layers=2)
    images = {"wide": make_image(root / "wide.png", 150, 90, 0), "tall": make_image(root / "tall.png", 70, 130, 1)}
    rows = [(p, images[i] if i else None) for p, i in TASKS]
    before = _greedy(model, rows)
    at = next(k for k in range(2, MAX_NEW) if before[0][k] not in before[0][:k])
    a = before[0][at]
    b = max(set(range(Snapshot(model).text_config["vocab_size"])) - {t for seq in before for t in seq})
    assert a < b
    _plant_tie(model, a, b)
    head = save_head(init_head(head_config_for(Snapshot(model), 1, 6, pick_mask_token(Snapshot(model))), seed=3),
                     root / "head")
    arts = {dtype: export_artifacts(model, head, root / f"art_{dtype}", dtype=dtype, max_tree=32, max_context=256,
                                    progress=lambda _: None) for dtype in ("fp32", "fp16")}
    tasks = _write_tasks(root / "tasks.jsonl", rows)
    reference = root / "refs" / "reference.json"
    assert export_main(["audit", "--save-reference", str(reference), "--model", str(model), "--data", str(tasks),
                        "--max-new-tokens", str(MAX_NEW)]) == 0
    return NearTie(model, head, tasks, arts["fp32"], arts["fp16"], reference, a, b, at)


def _audit(capsys, reference: Path, artifacts: Path, tasks: Path, *extra: str) -> tuple[int, dict]:
    code = export_main(["audit", "--reference", str(reference), "--artifacts", str(artifacts), "--data", str(tasks),
                        "--budget", "8", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def _refusal(capsys, argv: list[str]) -> str:
    code = export_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("glance-export: error:"), err
    return err[0]


def test_margin_oracle_returns_the_oracle_tokens(near_tie):
    snap = Snapshot(near_tie.model)
    model = snap.load_model("float32")
    for prompt, image in TASKS[:2]:
        built = snap.build_prompt(prompt, near_tie.tasks.parent / f"{image}.png" if image else None)
        tokens, margins = greedy_with_margins(model, snap, built, MAX_NEW, snap.stop_token_ids)
        assert tokens == greedy_reference(model, snap, built, MAX_NEW, snap.stop_token_ids)
        assert len(margins) == len(tokens) and min(margins) >= 0


def test_saved_reference_records_tokens_margins_and_identity(near_tie):
    ref = load_reference(near_tie.reference)
    assert ref.source == load_manifest(near_tie.fp32).source == load_manifest(near_tie.fp16).source
    assert ref.max_new_tokens == MAX_NEW and ref.recorded_with["dtype"] == "float32"
    assert [t.prompt for t in ref.tasks] == [p for p, _ in TASKS]
    assert [t.image_sha256 is None for t in ref.tasks] == [i is None for _, i in TASKS]
    first = ref.tasks[0]
    assert first.tokens[near_tie.at] == near_tie.b and first.margins[near_tie.at] < 1e-2
    assert all(len(t.margins) == len(t.tokens) for t in ref.tasks)
    assert statistics.median(m for t in ref.tasks for m in t.margins) > 100 * first.margins[near_tie.at]
    assert [p.name for p in near_tie.reference.parent.iterdir()] == ["reference.json"]  # no temporary left behind


def test_fp32_artifacts_match_the_reference_on_every_prompt(near_tie, capsys):
    code, report = _audit(capsys, near_tie.reference, near_tie.fp32, near_tie.tasks)
    assert code == 0 and report["passed"] and report["precision"] == "fp32" and report["n"] == len(TASKS)
    assert report["identical"] == report["own_greedy_identical"] == report["identical_to_own_greedy"] == len(TASKS)
    assert all(row["first_divergence"] is None and row["same_pixels"] for row in report["prompts"])


def test_torch_backend_audits_against_the_reference(near_tie, capsys):
    code = export_main(["audit", "--reference", str(near_tie.reference), "--backend", "torch", "--model",
                        str(near_tie.model), "--head", str(near_tie.head), "--data", str(near_tie.tasks),
                        "--budget", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["backend"] == "torch" and report["identical"] == len(TASKS)


def test_fp16_divergence_is_reported_with_its_fp32_margin(near_tie, capsys):
    code, report = _audit(capsys, near_tie.reference, near_tie.fp16, near_tie.tasks)
    margin = load_reference(near_tie.reference).tasks[0].margins[near_tie.at]
    assert report["precision"] == "fp16" and report["backend"] == "onnxruntime"
    for row in report["prompts"]:
        for diff in (row, row["own_greedy"]):
            assert diff["identical"] == (diff["first_divergence"] is None)
            assert (diff["fp32_margin"] is None) == diff["identical"]
        assert set(row["glance_vs_own_greedy"]) == {"identical", "first_divergence", "fp32_margin"}
    first = report["prompts"][0]
    for diff in (first, first["own_greedy"]):
        found = (diff["first_divergence"], diff["token"], diff["reference_token"])
        assert found == (near_tie.at, near_tie.a, near_tie.b)
        assert diff["fp32_margin"] == margin
    assert report["identical"] >= report["own_greedy_identical"] and report["passed"] and code == 0
    assert report["first_divergence"][0] == near_tie.at

    assert export_main(["audit", "--reference", str(near_tie.reference), "--artifacts", str(near_tie.fp16),
                        "--data", str(near_tie.tasks), "--budget", "8"]) == 0
    text = capsys.readouterr().out
    assert f"at token {near_tie.at} (fp32 top-2 margin {margin:.4g}, {near_tie.a} instead of {near_tie.b})" in text
    assert text.splitlines()[-1].startswith("PASS (fp16:")


def test_reference_for_another_model_is_refused(near_tie, snapshot_dir, tmp_path, capsys):
    other = tmp_path / "other.json"
    assert export_main(["audit", "--save-reference", str(other), "--model", str(snapshot_dir("qwen2_5_vl")),
                        "--data", str(near_tie.tasks), "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    line = _refusal(capsys, ["audit", "--reference", str(other), "--artifacts", str(near_tie.fp32),
                             "--data", str(near_tie.tasks)])
    assert "another model" in line


def test_other_tasks_and_settings_are_refused(near_tie, tmp_path, capsys):
    rows = [json.loads(line) for line in near_tie.tasks.read_text().splitlines()]
    base = ["audit", "--reference", str(near_tie.reference), "--artifacts", str(near_tie.fp32)]
    changed = _write_tasks(tmp_path / "changed.jsonl", [("What is drawn?", rows[0]["image"])] +
                           [(r["prompt"], r.get("image")) for r in rows[1:]])
    assert "another prompt" in _refusal(capsys, base + ["--data", str(changed)])
    fewer = _write_tasks(tmp_path / "fewer.jsonl", [(r["prompt"], r.get("image")) for r in rows[:2]])
    assert "holds 3 prompts" in _refusal(capsys, base + ["--data", str(fewer)])
    swapped = _write_tasks(tmp_path / "swapped.jsonl", [(rows[0]["prompt"], rows[2]["image"])] +
                           [(r["prompt"], r.get("image")) for r in rows[1:]])
    assert "another image" in _refusal(capsys, base + ["--data", str(swapped)])
    line = _refusal(capsys, base + ["--data", str(near_tie.tasks), "--max-new-tokens", "5"])
    assert f"--max-new-tokens {MAX_NEW}" in line


def test_a_prompt_that_tokenizes_differently_is_refused(near_tie, tmp_path, capsys):
    """As if the workstation's tokenizer or template had differed from the one the artifacts carry."""
    ref = load_reference(near_tie.reference)
    other_ids = replace(ref.tasks[1], input_ids_sha256=ids_sha256(np.arange(5)))
    foreign = write_reference(tmp_path / "foreign.json", replace(ref, tasks=(ref.tasks[0], other_ids, *ref.tasks[2:])))
    line = _refusal(capsys, ["audit", "--reference", str(foreign), "--artifacts", str(near_tie.fp32),
                             "--data", str(near_tie.tasks), "--budget", "8"])
    assert "prompt 2 becomes other token ids" in line


def test_damaged_references_are_refused(near_tie, tmp_path, capsys):
    raw = json.loads(near_tie.reference.read_text())
    raw["payload"]["tasks"][0]["tokens"][0] += 1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(raw))
    truncated = tmp_path / "truncated.json"
    truncated.write_text(near_tie.reference.read_text()[:500])
    cases = {edited: "fails its checksum", truncated: "damaged or truncated",
             DEFAULT_ARTIFACTS / "manifest.json": "not a GLANCE reference", tmp_path / "absent.json": "does not exist"}
    for path, words in cases.items():
        line = _refusal(capsys, ["audit", "--reference", str(path), "--artifacts", str(near_tie.fp32),
                                 "--data", str(near_tie.tasks)])
        assert words in line and "--save-reference" in line, line
    assert "is a directory" in _refusal(capsys, ["audit", "--save-reference", str(tmp_path), "--data",
                                                 str(near_tie.tasks)])


EDGE_AUDIT = BLOCK_EXPORT_STACK + """
from glance_export.cli import main
code = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _edge(args: list[str]) -> subprocess.CompletedProcess:
    """glance-export on an edge install: no torch, transformers, safetensors or onnx importable."""
    return subprocess.run([sys.executable, "-c", EDGE_AUDIT, "audit", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)


def test_edge_install_audits_against_the_reference_without_torch(near_tie):
    run = _edge(["--reference", str(near_tie.reference), "--artifacts", str(near_tie.fp16),
                 "--data", str(near_tie.tasks), "--budget", "8"])
    assert run.returncode == 0, run.stderr
    assert "onnxruntime fp16 vs fp32 reference" in run.stdout and f"at token {near_tie.at}" in run.stdout
    assert "torch imported: False" in run.stderr
    saving = _edge(["--save-reference", str(near_tie.tasks.parent / "edge.json"), "--data", str(near_tie.tasks)])
    errors = [line for line in saving.stderr.splitlines() if line.startswith("glance-export: error:")]
    assert saving.returncode == 2 and len(errors) == 1 and "--reference FILE" in errors[0]


def test_embedded_default_round_trip(tmp_path, capsys):
    """The README path: record on the workstation, audit the shipped graphs with the recorded file."""
    lines = (EXAMPLES / "receipt" / "tasks.jsonl").read_text().splitlines()[:3]
    rows = [json.loads(line) for line in lines]
    tasks = _write_tasks(tmp_path / "tasks.jsonl", [(r["prompt"], EXAMPLES / "receipt" / r["image"]) for r in rows])
    reference = tmp_path / "receipt.json"
    assert export_main(["audit", "--save-reference", str(reference), "--data", str(tasks),
                        "--max-new-tokens", "16"]) == 0
    capsys.readouterr()
    run = _edge(["--reference", str(reference), "--data", str(tasks), "--json"])
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["identical"] == report["n"] == 3 and report["precision"] == "fp32" and report["tau"] > 1.5
    assert report["budget"] == 63
    shipped = Path(shutil.copytree(DEFAULT_ARTIFACTS, tmp_path / "shipped",
                                   ignore=shutil.ignore_patterns("*cost-profile-*")))  # measured here, not in models/
    run = _edge(["--reference", str(reference), "--data", str(tasks), "--artifacts", str(shipped), "--budget", "auto",
                 "--json"])
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["identical"] == report["n"] == 3 and report["budget"] == "auto" and report["passed"]
    assert "measuring round costs" in run.stderr and len(list(shipped.glob("cost-profile-*.json"))) == 1
