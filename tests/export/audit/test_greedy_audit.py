"""The oracle audit on graphs: where GLANCE and the graphs' own greedy decode part, the report gives the
greedy choice's top-2 logit margin there, read from the same graphs (checked here against the torch model's
own margins on the embedded default, whose fp32 graphs compute what it does)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from glance_export.audit.greedy_audit import audit, divergence_margin
from glance_export.model.adapters import Snapshot
from glance_export.model.torch_backend import greedy_with_margins
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.sampling import SamplingParams
from glance_runtime.decode.session import Settings
from glance_runtime.defaults import DEFAULT_ARTIFACTS, DEFAULT_MODEL
from glance_runtime.formats.tasks import read as read_tasks

REPO = Path(__file__).resolve().parents[3]
RECEIPT = REPO / "examples/demo/receipt.png"


@pytest.fixture(scope="module")
def session():
    s = open_session(Source("onnxruntime", artifacts=DEFAULT_ARTIFACTS, threads=1),
                     Settings(budget=15, max_new_tokens=12))
    yield s
    s.close()


def test_divergence_margin_is_the_greedy_choices_top2_gap(session):
    prompt = session.prompt("What is the total?", RECEIPT)
    tokens = session.greedy(prompt)
    snap = Snapshot(DEFAULT_MODEL)
    ref, margins = greedy_with_margins(snap.load_model("float32"), snap, snap.build_prompt("What is the total?", RECEIPT),
                                       len(tokens), snap.stop_token_ids)
    assert ref == tokens
    for i in (1, 3, len(tokens) - 1):
        assert divergence_margin(session, prompt, tokens, i) == pytest.approx(margins[i], abs=1e-3)
    assert divergence_margin(session, prompt, tokens, 0) is None  # the prefill's token: no verify pass chose it


def test_the_report_says_how_the_graphs_compute_and_lists_divergences(session, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "What is the total?", "image": str(RECEIPT)}) + "\n")
    report = audit(session, read_tasks(tasks))
    assert report["int8_activations"] is False and report["divergences"] == [] and report["passed"]
    assert report["prompts"][0]["margin"] is None


def test_a_sampled_audit_holds_glance_to_plain_sampling_with_the_same_seeds(session, tmp_path):
    """Task i is sampled with the seed + i by GLANCE and by plain sampling alike: identical, and not greedy's."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Describe this.", "Name a colour.")))
    sampled = audit(session, read_tasks(tasks), sampling=SamplingParams(temperature=1.5, seed=3))
    assert sampled["passed"] and sampled["identical"] == sampled["n"] == 2 and sampled["sampling"]["seed"] == 3
    greedy = audit(session, read_tasks(tasks))
    assert greedy["sampling"] is None and [p["tokens"] for p in greedy["prompts"]] != [p["tokens"] for p in
                                                                                       sampled["prompts"]]
