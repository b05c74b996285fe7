"""Parity suite: GLANCE on the torch backend must reproduce the greedy oracle token for token (fp32).

Covers every family, text and image prompts of several shapes, budgets {chain, 8, 31, 63, auto} and block
sizes {4, 8, 16}; with seeded drafters, full / partial / zero / off-first-branch acceptance and stop
tokens inside an accepted path; and the committed KV rows against a fresh prefill. Auto runs with policies
that force rounds skipping the draft and cuts of every size down to none (tests/support.py).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from glance_runtime.backends.seeded import SeededDrafter
from glance_export.model.torch_backend import TorchBackend, greedy_reference
from glance_runtime.decode.loop import DecodeConfig, decode
from support import ALL_FAMILIES, VL_FAMILIES, check_mixed, config, cutting, median_surprisal, shallow, skipping

MAX_NEW = 24
BUDGETS = {"chain": (15, 1), "b8": (8, 8), "b31": (31, 8), "b63": (63, 8)}


def _prompt(backend: TorchBackend, images, image: str | None, text: str = "What colour is the square?"):
    return backend.snapshot.build_prompt(text, images[image] if image else None)


def _oracle(backend: TorchBackend, prompt, stops=()):
    return greedy_reference(backend.model, backend.snapshot, prompt, MAX_NEW, stops)


@pytest.fixture(scope="module")
def oracle_for(backend_for, images):
    """The oracle depends on the target and prompt only, so each is decoded once for all tree settings."""
    cache: dict[tuple[str, str | None], list[int]] = {}

    def get(family: str, image: str | None) -> list[int]:
        if (family, image) not in cache:
            backend = backend_for(family, 4)
            cache[family, image] = _oracle(backend, _prompt(backend, images, image))
        return cache[family, image]

    return get


def _cases():
    for family in ALL_FAMILIES:
        for image in (["wide", "tall", None] if family in VL_FAMILIES else [None]):
            yield family, image


@pytest.mark.parametrize("family,image", list(_cases()))
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("block_size", [pytest.param(4, marks=pytest.mark.slow), 8,
                                        pytest.param(16, marks=pytest.mark.slow)])
def test_random_head_matches_oracle(backend_for, oracle_for, images, family, image, budget, block_size):
    backend = backend_for(family, block_size)
    prompt = _prompt(backend, images, image)
    nodes, k = BUDGETS[budget]
    cfg = DecodeConfig(max_new_tokens=MAX_NEW, budget=min(nodes, block_size - 1) if k == 1 else nodes, branch_k=k)
    assert decode(backend, prompt, cfg).tokens == oracle_for(family, image)


AUTO_CASES = [(f, i, 8) for f, i in _cases()] + [(f, "wide" if f in VL_FAMILIES else None, b)
                                                 for f in ALL_FAMILIES for b in (4, 16)]


@pytest.mark.parametrize("family,image,block_size", AUTO_CASES)
def test_auto_matches_oracle(backend_for, oracle_for, images, family, image, block_size):
    """Lossless whatever auto decides: rounds that skip the draft, cuts of any size, drafts short of the block,
    with a random head and with seeded drafts that accept several tokens a round."""
    backend = backend_for(family, block_size)
    prompt = _prompt(backend, images, image)
    truth = oracle_for(family, image)
    split = median_surprisal(backend, prompt, MAX_NEW)
    seeded = SeededDrafter(backend, truth, prompt.length, SEEDS["partial"])
    for policy in (skipping, cutting, shallow):
        for drafter in (backend, seeded):
            result = decode(drafter, prompt, config(policy(split, block_size), MAX_NEW))
            assert result.tokens == truth, (policy.__name__, drafter is seeded)
            check_mixed(result, policy.__name__, seeded=drafter is seeded)


def test_output_depends_on_image_and_text(backend_for, images):
    """Guards the suite itself: a collapsed target would make every parity check vacuous."""
    backend = backend_for("qwen2_5_vl")
    outs = {tuple(_oracle(backend, _prompt(backend, images, name))) for name in ("wide", "tall", "square")}
    outs.add(tuple(_oracle(backend, _prompt(backend, images, "wide", "Describe the image."))))
    assert len(outs) == 4
    assert all(len(set(o)) > 3 for o in outs)


SEEDS = {  # draft offset -> top-k column of the true token (None: absent)
    "full": lambda d: 0,
    "partial": lambda d: 0 if d <= 2 else None,
    "zero": lambda d: None,
    "second_branch": lambda d: 1 if d == 1 else 0,
}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2_vl", "llama"])
@pytest.mark.parametrize("seed,budget", [(s, b) for s in SEEDS for b in ("chain", "b31")
                                         if not (s == "second_branch" and b == "chain")])  # a chain has one branch
def test_seeded_acceptance(backend_for, oracle_for, images, family, seed, budget):
    backend = backend_for(family, 8)
    image = "wide" if family in VL_FAMILIES else None
    prompt = _prompt(backend, images, image)
    truth = oracle_for(family, image)
    nodes, k = BUDGETS[budget]
    drafter = SeededDrafter(backend, truth, prompt.length, SEEDS[seed])
    result = decode(drafter, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=min(nodes, 7) if k == 1 else nodes,
                                                  branch_k=k))
    assert result.tokens == truth
    taus = [r.accepted for r in result.rounds[:-1]]  # the last round is cut by max_new_tokens
    if seed == "zero":
        assert all(t == 1 for t in taus)
    elif k == 1:  # a chain holds every seeded offset, so acceptance is exact
        assert taus and all(t == (3 if seed == "partial" else 8) for t in taus)
    elif seed == "partial":  # a tree may drop deep nodes in favour of siblings, never the best first one
        assert taus and all(2 <= t <= 3 for t in taus)
    else:
        assert taus and all(t >= 2 for t in taus), "the walk must accept past the root's seeded child"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_stop_token_is_accepted_as_the_last_node_of_its_branch(backend_for, images, family):
    backend = backend_for(family, 8)
    prompt = _prompt(backend, images, "wide" if family in VL_FAMILIES else None)
    truth = _oracle(backend, prompt)
    stop = truth[5]  # lands mid-block: the first round commits tokens 1..8
    expected = _oracle(backend, prompt, stops=(stop,))
    assert expected[-1] == stop and len(expected) < len(truth)
    drafter = SeededDrafter(backend, truth, prompt.length, lambda d: 0)
    result = decode(drafter, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=7, branch_k=1), stop_ids=(stop,))
    assert result.tokens == expected and result.stopped_on == stop
    depth = len(expected) - 1  # the stop token's offset from the prefill's anchor
    first = result.rounds[0]
    assert depth < 7 and first.path == list(range(1, depth + 1)), "accepted within the first round's block"
    assert first.tree_size == depth + 1, "nothing drafted below the stop token is verified"
    assert first.accepted == depth, "the target's token after the stop is no token of the answer: not counted"


def test_no_tree_reaches_past_max_new_tokens(backend_for):
    backend = backend_for("qwen2", 8)
    prompt = backend.snapshot.build_prompt("Hello there")
    truth = _oracle(backend, prompt)
    result = decode(SeededDrafter(backend, truth, prompt.length, lambda d: 0), prompt,
                    DecodeConfig(max_new_tokens=5, budget=7, branch_k=1))
    assert result.tokens == truth[:5]
    assert [r.tree_size for r in result.rounds] == [4], "4 tokens left after the prefill's: 3 drafted, 1 bonus"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llama"])
def test_committed_kv_and_head_context_match_fresh_prefill(backend_for, images, family):
    """After multi-token rounds, every kept KV row and head context row equals a fresh prefill's."""
    backend = backend_for(family, 8)
    prompt = _prompt(backend, images, "tall" if family in VL_FAMILIES else None)
    truth = _oracle(backend, prompt)
    drafter = SeededDrafter(backend, truth, prompt.length, lambda d: 0 if d % 3 else 1)
    result = decode(drafter, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=31, branch_k=8))
    assert result.tokens == truth and max(r.accepted for r in result.rounds) > 1
    backend.draft(result.tokens[-1], 2)  # folds the last round's rows into the head's context cache
    # Every token but the last is a committed row (the last is the anchor of a round that never came):
    # no tree reaches past max_new_tokens, so no row lies beyond the answer.
    rows = backend.start
    longer = greedy_reference(backend.model, backend.snapshot, prompt, rows - prompt.length, ())
    assert rows == prompt.length + len(result.tokens) - 1 and longer == truth[:-1]

    fresh = TorchBackend(backend.snapshot, backend.head, model=backend.model)
    extended = type(prompt)(np.concatenate([prompt.input_ids, longer]), prompt.pixel_values,
                            prompt.image_grid_thw)
    fresh.prefill(extended)
    for kept, ref in zip(backend.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(kept.keys, ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kept.values, ref.values, atol=1e-4, rtol=1e-4)
    taps = fresh.pending_taps[0][None]
    expected = backend.head.context_kv(taps, torch.arange(rows)[None])
    for (k, v), (k_ref, v_ref) in zip(backend.head_kv, expected):
        torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)


def _context_end_runs(backend, truth, prompt, split: float):
    """Greedy, a fixed tree, seeded full acceptance (the deepest trees) and auto, each cut by the room left."""
    seeded = SeededDrafter(backend, truth, prompt.length, SEEDS["full"])
    yield "b31", backend, DecodeConfig(max_new_tokens=MAX_NEW, budget=31, branch_k=8)
    yield "seeded", seeded, DecodeConfig(max_new_tokens=MAX_NEW, budget=31, branch_k=8)
    yield "auto", seeded, config(cutting(split, backend.block_size), MAX_NEW)


@pytest.mark.parametrize("family", [f if f == "qwen2_5_vl" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in ALL_FAMILIES])
def test_context_end_trees_fit_the_room_left(backend_for, oracle_for, images, family):
    """With a context limit anywhere from the prompt length to past the answer, every round's tree fits the
    rows left (down to the anchor alone, a plain greedy step) and the tokens stay the oracle's."""
    backend = backend_for(family, 8)
    image = "wide" if family in VL_FAMILIES else None
    prompt = _prompt(backend, images, image)
    truth = oracle_for(family, image)
    split = median_surprisal(backend, prompt, MAX_NEW)
    unbounded = backend.info
    try:
        for limit in range(prompt.length, prompt.length + MAX_NEW + 1):
            # the bound a graph backend declares; the loop reads it with the committed rows
            backend.info = replace(unbounded, limits=replace(unbounded.limits, max_context=limit))
            for name, drafter, cfg in _context_end_runs(backend, truth, prompt, split):
                result = decode(drafter, prompt, cfg)
                assert result.tokens == truth, (limit, name)
                start = prompt.length
                for r in result.rounds:
                    assert r.tree_size <= max(1, limit - start), (limit, name, start, r.tree_size)
                    assert r.drafted or r.tree_size == 1
                    start += r.accepted
                if name == "seeded" and limit >= prompt.length + 3:
                    assert max(r.accepted for r in result.rounds) > 1, "no round accepted a drafted token"
    finally:
        backend.info = unbounded
