"""The shipped default model and the README demo: `glance-run` with no --model answers every example
image correctly on ONNX Runtime, speculation changes nothing, and the held-out sets audit identical."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glance_export.cli import main as export_main
from glance_export.train import corpus
from glance_runtime.cli.run import main as run_main
from glance_runtime.defaults import DEFAULT_ARTIFACTS, DEFAULT_HEAD, DEFAULT_MODEL, MODELS_ROOT, resolve
from glance_runtime.formats.artifacts import check_source, read as load_manifest
from glance_runtime.store.integrity import sha256
from support import BLOCK_TRAINING_STACK

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROMPTS = json.loads((EXAMPLES / "demo" / "prompts.json").read_text())


def _run(args: list[str], capsys) -> dict:
    assert run_main(args + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.edge
@pytest.mark.parametrize("kind", corpus.KINDS)
def test_demo_answers_the_example_image(kind, capsys):
    """As the README runs it (auto, whose trees follow this machine's timings: only its tokens are checked), and at
    a fixed budget, whose trees and so tau depend on the tokens alone."""
    args = ["--image", str(EXAMPLES / "demo" / f"{kind}.png"), "--prompt", PROMPTS[f"{kind}.png"]]
    auto, fixed, plain = _run(args, capsys), _run(args + ["--budget", "15"], capsys), _run(args + ["--no-spec"], capsys)
    drawn = corpus.demo_sample(kind)
    assert auto["backend"] == "onnxruntime" and auto["text"] in drawn.answers
    assert auto["token_ids"] == fixed["token_ids"] == plain["token_ids"] and plain["tau"] == 1.0
    if kind in ("receipt", "chart"):
        assert fixed["tau"] >= 3.0


@pytest.mark.edge
def test_embedded_default_is_served_from_shipped_graphs_only_with_its_own_head(tmp_path):
    assert resolve(None, None, None, None) == (DEFAULT_MODEL, DEFAULT_HEAD, DEFAULT_ARTIFACTS, "onnxruntime")
    assert resolve(None, None, None, "torch") == (DEFAULT_MODEL, DEFAULT_HEAD, None, "torch")
    other = tmp_path / "head"
    assert resolve(None, other, None, "onnxruntime") == (DEFAULT_MODEL, other, None, "onnxruntime")
    assert resolve(tmp_path, None, None, None) == (tmp_path, None, None, "torch")
    assert resolve(None, None, tmp_path, None) == (None, None, tmp_path, "onnxruntime")


@pytest.mark.edge
def test_examples_are_the_generator_output():
    for kind in corpus.KINDS:
        rows = corpus.read_task_file(EXAMPLES / kind / "tasks.jsonl")
        drawn = corpus.heldout(kind, len(rows), 0)
        assert [(r["prompt"], r["answer"]) for r in rows] == [(s.prompt, s.answer) for s in drawn]
    assert PROMPTS == {f"{k}.png": corpus.demo_sample(k).prompt for k in corpus.KINDS}


@pytest.mark.slow  # audits every held-out set
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_heldout_sets_audit_identical_to_greedy(backend, capsys):
    for kind in corpus.KINDS:
        code = export_main(["audit", "--backend", backend, "--data", str(EXAMPLES / kind / "tasks.jsonl"),
                            "--max-new-tokens", "32", "--json"])
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["n"] == 20 and report["identical"] == 20, (kind, report["first_divergence"])
        assert report["self_consistent"] == 20 and report["tau"] > 1.5


@pytest.mark.edge
def test_shipped_model_fits_the_size_cap_and_has_a_card():
    files = [p for p in MODELS_ROOT.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 60 * 2**20
    assert (DEFAULT_MODEL / "MODEL_CARD.md").is_file() and (DEFAULT_HEAD / "config.json").is_file()
    assert not [p for p in files if p.suffix in (".pt", ".bin", ".pkl")]
    assert {p.parent for p in files if p.suffix == ".onnx"} == {DEFAULT_ARTIFACTS}


@pytest.mark.edge
def test_shipped_graphs_were_exported_from_the_shipped_weights():
    check_source(load_manifest(DEFAULT_ARTIFACTS), DEFAULT_MODEL)
    raw = json.loads((DEFAULT_ARTIFACTS / "manifest.json").read_text())
    assert raw["head"]["weights_sha256"] == sha256(DEFAULT_HEAD / "model.safetensors")


TORCH_FREE_DEMO = BLOCK_TRAINING_STACK + """
from glance_runtime.cli.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.edge
def test_demo_runs_on_an_edge_install_without_torch(tmp_path):
    env = {**os.environ, "GLANCE_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", TORCH_FREE_DEMO, "--image", str(EXAMPLES / "demo" / "receipt.png"),
                          "--prompt", PROMPTS["receipt.png"]], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() in corpus.demo_sample("receipt").answers
    assert "[onnxruntime] tau" in run.stderr and "exporting" not in run.stderr
    assert not (tmp_path / "cache" / "onnx").exists()  # no export; the cache holds only hash stamps
