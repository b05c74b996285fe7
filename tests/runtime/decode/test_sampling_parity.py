"""Sampling with speculation: for a seed, the tokens are plain sampling's (the same loop without a draft), whatever
the budget, auto's choices or the drafts; and ONNX Runtime's fp32 graphs sample what the torch reference samples.

The tiny models' random heads rarely propose the sampled token, so seeded drafters (the plain sampled answer put
into the head's top-k) make rounds accept several tokens; a walk that compared a node with anything but the
token sampled at its row's position would then part from plain sampling.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from glance_export.model.torch_backend import TorchBackend
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.decode.sampling import SamplingParams
from support import ALL_FAMILIES, VL_FAMILIES, config, cutting, median_surprisal, shallow

MAX_NEW = 24

SETTINGS = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, top_p=0.9, seed=2),
            SamplingParams(temperature=0.6, top_k=5, seed=3), SamplingParams(temperature=1.0, min_p=0.05, seed=4),
            SamplingParams(temperature=2.0, top_k=40, top_p=0.95, min_p=0.01, seed=2**62 + 7)]


def _plain(backend, prompt, params: SamplingParams) -> list[int]:
    return decode(backend, prompt, DecodeConfig(max_new_tokens=MAX_NEW, speculative=False, sampling=params)).tokens


def _runs(backend, prompt, params: SamplingParams, truth: list[int], split: float):
    """Every way a round can be shaped: fixed trees, seeded drafts that accept the sampled answer, and auto's
    policies that skip drafts, cut trees and draft short of the block."""
    seeded = SeededDrafter(backend, truth, prompt.length, lambda d: 0 if d % 3 else 1)
    for budget in (3, 15):
        yield f"b{budget}", backend, DecodeConfig(max_new_tokens=MAX_NEW, budget=budget, branch_k=8, sampling=params)
    yield "seeded", seeded, DecodeConfig(max_new_tokens=MAX_NEW, budget=31, branch_k=8, sampling=params)
    for policy in (cutting, shallow):
        cfg = config(policy(split, backend.block_size), MAX_NEW)
        yield policy.__name__, seeded, DecodeConfig(max_new_tokens=MAX_NEW, budget=cfg.budget, branch_k=8,
                                                    auto=cfg.auto, sampling=params)


@pytest.mark.parametrize("family", [f if f in ("qwen2_5_vl", "qwen3") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in ALL_FAMILIES])
def test_speculation_samples_what_plain_sampling_does(backend_for, images, family):
    backend = backend_for(family)
    image = images["wide"] if family in VL_FAMILIES else None
    prompt = backend.snapshot.build_prompt("Describe the picture.", image)
    split = median_surprisal(backend, prompt, MAX_NEW)
    answers = set()
    for params in SETTINGS:
        truth = _plain(backend, prompt, params)
        answers.add(tuple(truth))
        for name, drafter, cfg in _runs(backend, prompt, params, truth, split):
            result = decode(drafter, prompt, cfg)
            assert result.tokens == truth, (name, params)
            if name == "seeded":
                assert max(r.accepted for r in result.rounds) > 2, "no round accepted the seeded sample"
    assert len(answers) == len(SETTINGS), "the settings must sample different answers"


def test_a_seed_decides_the_answer_and_greedy_stays_greedy(backend_for, images):
    backend = backend_for("qwen2_5_vl")
    prompt = backend.snapshot.build_prompt("Describe the picture.", images["tall"])
    first = _plain(backend, prompt, SamplingParams(temperature=1.5, seed=11))
    assert _plain(backend, prompt, SamplingParams(temperature=1.5, seed=11)) == first
    assert _plain(backend, prompt, SamplingParams(temperature=1.5, seed=12)) != first
    greedy = decode(backend, prompt, DecodeConfig(max_new_tokens=MAX_NEW, speculative=False)).tokens
    assert _plain(backend, prompt, SamplingParams(temperature=1e-6, seed=5)) == greedy
    with pytest.raises(ValueError, match="seed"):
        _plain(backend, prompt, SamplingParams(temperature=0.7))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**63 - 1), temperature=st.floats(0.05, 4.0), top_p=st.floats(0.05, 1.0),
       top_k=st.integers(0, 60), min_p=st.floats(0.0, 0.5), budget=st.sampled_from([1, 2, 7, 31]))
@example(seed=0, temperature=2.5, top_p=0.3125, top_k=24, min_p=0.25, budget=7)  # top-p once weighed min-p's tokens
def test_any_setting_samples_alike_draft_on_or_off(backend_for, seed, temperature, top_p, top_k, min_p, budget):
    backend = backend_for("qwen3")
    prompt = backend.snapshot.build_prompt("Name three colours.", None)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed).check()
    truth = _plain(backend, prompt, params)
    seeded = SeededDrafter(backend, truth, prompt.length, lambda d: 0)
    cfg = DecodeConfig(max_new_tokens=MAX_NEW, budget=budget, branch_k=8, sampling=params)
    assert decode(seeded, prompt, cfg).tokens == truth
    assert decode(backend, prompt, cfg).tokens == truth


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_onnx_runtime_samples_what_the_reference_samples(ort_exported, images, family):
    """fp32 graphs against the torch reference, plain and speculative, on the same seeds."""
    ex = ort_exported(family)
    image = images["wide"] if family in VL_FAMILIES else None
    prompt = ex.prompt(image)
    torch_backend = TorchBackend(ex.snapshot, model=ex.model)
    for params in SETTINGS[:3]:
        truth = _plain(torch_backend, prompt, params)
        assert _plain(ex.backend, prompt, params) == truth, params
        seeded = SeededDrafter(ex.backend, truth, prompt.length, lambda d: 0 if d % 2 else 1)
        for budget in (7, 31):
            cfg = DecodeConfig(max_new_tokens=MAX_NEW, budget=budget, branch_k=8, sampling=params)
            assert decode(seeded, prompt, cfg).tokens == truth, (params, budget)
            assert decode(ex.backend, prompt, cfg).tokens == truth, (params, budget)
