"""A batched model never writes single-sequence costs it did not measure, and no cost it keeps or stores divides by
zero. A sequence decoding alone in a batch runs between batched passes, so its rounds' times are not what the stored
profile stands for: refined from them, repeated batched server runs drove the profile toward zero, until a cost
rounded to 0 and the next comparison divided by it. The batched decodes here run the embedded default's graphs on
real ONNX Runtime sessions over a profile whose costs are constructed; the other checks drive the cost models with
constructed round times. Nothing asserted depends on a time taken during the test."""
from __future__ import annotations

import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import glance_runtime as gr
from glance_runtime.decode.batch_budget import BatchBudget, BatchCost, start_from_profile
from glance_runtime.decode.calibration import Calibration
from glance_runtime.decode.cost_profile import load, save
from glance_runtime.decode.cost_watch import CostWatch
from glance_runtime.decode.tree import build_tree
from glance_runtime.defaults import DEFAULT_ARTIFACTS
from glance_runtime.formats.cost import CostProfile
from support import RECEIPT, within

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

WAIT_S = 300  # far above any decode here: only a blocked call reaches it
MAX_TOKENS = 40
PROMPTS = ["What is the total?", {"prompt": "What is the date?", "images": [str(RECEIPT)]}, "Describe this.",
           "Name a colour.", {"prompt": "What is the total?", "images": [str(RECEIPT)]}, "Hello"]
ROWS = (1, 2, 4, 8, 16, 32, 64)


@pytest.fixture
def artifacts(tmp_path) -> Path:
    """A writable copy of the default's graphs whose stored profile holds constructed costs: the one glance-run
    measures on first use (so it is this device's, and read as is), its costs replaced by a steep CPU-like curve
    nothing has confirmed."""
    copy = tmp_path / "art"
    shutil.copytree(DEFAULT_ARTIFACTS, copy, ignore=shutil.ignore_patterns("cost-profile-*", ".cost-profile-*"))
    with gr.load(copy, threads=1) as model:
        assert model.budget == "auto"  # resolving auto measures and stores the profile: a single-sequence measurement
    (path,) = copy.glob("cost-profile-*.json")
    measured = load(path)
    save(replace(measured, verify_ms=tuple(0.5 + 0.25 * r for r in measured.rows), draft_ms=0.4, checked_rows=(),
                 draft_checked=False, spread=(), load_average=None, provisional=False), path)
    return copy


def test_batched_decoding_writes_no_single_sequence_costs(artifacts):
    """Three processes' worth of batched decoding (a batch of several requests, and one request alone on the
    batched model, each round of it a single-sequence round between nothing else) leave the stored profile
    byte for byte as it was, and nothing on the way warns."""
    (path,) = artifacts.glob("cost-profile-*.json")
    stored = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            with gr.load(artifacts, threads=1, max_batch=4) as model:
                assert model.budget == "auto"
                within(WAIT_S, lambda: model.generate(PROMPTS, max_new_tokens=MAX_TOKENS))
                within(WAIT_S, lambda: model.generate("Describe this.", max_new_tokens=MAX_TOKENS))
    assert path.read_bytes() == stored, load(path)


def test_costs_learned_toward_zero_are_stored_at_the_profiles_resolution_without_dividing_by_zero():
    """A profile already at 0.001 ms a row, shown a slow one-row round and trees a thousand times cheaper (the pattern
    that drove a stored profile toward zero): what is stored stays a positive cost the profile format reads, and
    refining on from it divides by no zero."""
    base = CostProfile(device="constructed", rows=ROWS, verify_ms=(0.001,) * len(ROWS), draft_ms=0.001, repeats=3,
                       measured_at="2026-01-01T00:00:00")
    stored: list[CostProfile] = []
    watch = CostWatch(base, stored.append, max_rows=64, full_depth=15)
    rounds = [(1, 1.0), (1, 1.0), (1, 1.1), (8, 0.001), (8, 0.001), (16, 0.001), (16, 0.001), (2, 1.0), (4, 1.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows, ms in rounds * 3:
            watch.observe(rows, ms, None, None)
        watch.settle()
    assert stored
    for profile in stored:
        assert min(profile.verify_ms) > 0 and profile.draft_ms > 0, profile
        assert CostProfile.from_dict(profile.as_dict()) == profile


def test_a_batch_cost_fitted_to_rounds_cheaper_than_its_rows_never_divides_by_zero():
    """Batched rounds timed far below what the profile's cost a row says (its slope is not refitted) pull every
    fitted coefficient to zero: the batch's policy still plans, grows and cuts without dividing by zero."""
    cost = BatchCost(start_from_profile(np.linspace(1.0, 4.0, 64), 0.5))
    policy = BatchBudget(cost, Calibration(law=(2.0, 0.5)), max_nodes=15)
    policy.switch.drafting = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(60):
            policy.observe(4, 16, 64, 4, 0.01)
        assert cost.ms(4, 1, 4, 0) > 0
        depths = policy.plan([1.0, None, 2.0], [15, 15, 15])
        stop = policy.growth_stop(3)
        rng = np.random.default_rng(0)
        logp = np.log(np.sort(rng.dirichlet(np.ones(4), size=15), axis=1)[:, ::-1])
        ids = rng.integers(0, 100, size=(15, 4))
        trees = [build_tree(7, ids, logp, 15, stop=stop) for _ in depths]
        cut = policy.cut(trees, [1.0, None, 2.0], sum(d is not None for d in depths))
    assert len(cut) == 3
