"""Tests for glance_runtime.decode.sampling: the keyed noise pinned to numbers a torch or CUDA port must
reproduce, the sampler checked token for token against a plain per-row reference of the documented rule,
its independence of the batch and the vocabulary's size, and its frequencies against the tempered,
truncated softmax."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from glance_runtime.decode.sampling import (GAMMA, MAX_TOP_N, SEED_LIMIT, SamplingParams, gumbel, logprobs,
                                            noise_bits, sample, uniform)
from glance_runtime.errors import GlanceError, InputError

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

MASK = 2**64 - 1
# (seed, position, token) -> the hash's 64 bits and G, computed once with the pure-Python formula below
GOLDEN = {(0, 0, 0): (0xA706DD2F4D197E6F, 0.8509171899612384),
          (42, 7, 151935): (0xF297D61E9ABD4BA7, 2.9226334014504096),
          (2**63 - 1, 10**6, 3): (0xDB939392F11CED54, 1.874205293709447),
          (1, 0, 1): (0xFB85AF9C9A7E41F1, 4.03723791994817)}


def mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def bits(seed: int, position: int, token: int) -> int:
    return mix64((mix64((mix64(seed) + (position + 1) * GAMMA) & MASK) + (token + 1) * GAMMA) & MASK)


def noise(seed: int, position: int, token: int) -> float:
    return -math.log(-math.log(((bits(seed, position, token) >> 12) + 0.5) * 2.0**-52))


def kept_tokens(row: np.ndarray, params: SamplingParams) -> list[int]:
    """The documented truncation, one token at a time: (logit desc, id asc) order, then top-k, top-p, min-p."""
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))
    weight = np.exp((row - row.max()) / np.float32(params.temperature))
    keep = order[:params.top_k] if params.top_k else order
    if params.top_p < 1:
        total = sum(float(weight[t]) for t in keep)
        mass, nucleus = 0.0, []
        for t in keep:
            if mass >= params.top_p * total:
                break
            nucleus.append(t)
            mass += float(weight[t])
        keep = nucleus
    return [t for t in keep if weight[t] >= np.float32(params.min_p)]


def sample_one(row: np.ndarray, position: int, params: SamplingParams) -> int:
    """Gumbel-max over the kept tokens, ties to the lowest id."""
    s = (row - row.max()) / np.float32(params.temperature)
    scores = {t: float(s[t]) + noise(params.seed, position, t) for t in kept_tokens(row, params)}
    return min(scores, key=lambda t: (-scores[t], t))


def test_hash_is_splitmix64_and_pinned():
    assert [mix64(i * GAMMA & MASK) for i in (1, 2, 3)] == \
        [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]  # SplitMix64's published stream from 0
    for (seed, position, token), (pinned, g) in GOLDEN.items():
        assert bits(seed, position, token) == pinned
        assert noise(seed, position, token) == g
        assert int(noise_bits(seed, np.array([position]), np.array([token]))[0]) == pinned
        assert uniform(np.array([pinned], np.uint64))[0] == ((pinned >> 12) + 0.5) * 2.0**-52
        assert gumbel(seed, np.array([position]), np.array([token]))[0] == pytest.approx(g, rel=1e-14)
    ends = uniform(np.array([0, 2**12 - 1, MASK], np.uint64))
    assert ends.tolist() == [2.0**-53, 2.0**-53, 1 - 2.0**-53]  # the open interval's ends: never 0 or 1


def test_noise_depends_only_on_its_key():
    tokens = np.arange(50)
    wide = gumbel(5, np.array([[3], [9]]), np.arange(5000))  # [2, 5000]
    assert np.array_equal(gumbel(5, np.array([3]), tokens), wide[0, :50])
    assert np.array_equal(gumbel(5, np.array([9]), tokens[::-1]), wide[1, :50][::-1])
    assert not np.array_equal(wide[0], wide[1])
    assert not np.array_equal(gumbel(6, np.array([3]), tokens), wide[0, :50])


CASES = [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.6),
         SamplingParams(1.0, top_p=0.9), SamplingParams(0.8, min_p=0.2), SamplingParams(1.0, top_k=1),
         SamplingParams(0.6, top_p=0.8, top_k=20, min_p=0.05), SamplingParams(2.0, top_k=250, top_p=0.97),
         SamplingParams(1.0, min_p=1e-30)]


def rows(vocab: int) -> np.ndarray:
    """Peaked, flat and tied rows: coarse values make equal logits at the cuts common."""
    rng = np.random.default_rng(vocab)
    peaked = rng.normal(0, 1.5, (6, vocab))
    peaked[np.arange(6), rng.integers(0, vocab, 6)] += 14
    tied = rng.integers(-4, 3, (6, vocab)) / 2
    return np.concatenate([peaked, rng.normal(0, 1, (6, vocab)), tied]).astype(np.float32)


@pytest.mark.parametrize("params", CASES, ids=str)
@pytest.mark.parametrize("vocab", [40, 1000])
def test_sample_matches_the_documented_rule(params, vocab):
    logits, params = rows(vocab), params.with_seed(1234)
    positions = np.arange(len(logits)) * 7 % 5
    got = sample(logits, positions, params)
    assert got.dtype == np.int64
    assert got.tolist() == [sample_one(row, int(p), params) for row, p in zip(logits, positions)]


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_p=0.9), SamplingParams(0.8, min_p=0.01),
                                    SamplingParams(1.5, top_p=0.99, min_p=1e-4)], ids=str)
def test_peaked_rows_match_the_documented_rule(params):
    """Rows that keep few tokens (a copy of just the candidates, not the whole row) follow the same rule."""
    logits, params = rows(2000)[:6], params.with_seed(8)
    positions = np.arange(6) + 30
    assert sample(logits, positions, params).tolist() == [sample_one(r, int(p), params)
                                                          for r, p in zip(logits, positions)]


@pytest.mark.parametrize("params", CASES, ids=str)
def test_a_row_samples_the_same_alone_in_any_batch_and_vocabulary(params):
    logits, params = rows(300), params.with_seed(99)
    positions = np.array([4, 4, 4, 5, 5, 6] * 3)
    batch = sample(logits, positions, params)
    assert np.array_equal(batch, sample(logits.copy(), positions, params))
    for i in (0, 7, 17):
        assert sample(logits[i:i + 1], positions[i:i + 1], params)[0] == batch[i]
    wider = np.concatenate([logits, np.full((len(logits), 700), -np.inf, np.float32)], axis=1)
    assert np.array_equal(sample(wider, positions, params), batch)


def test_a_whole_vocabulary_samples_what_finishing_every_tokens_noise_does():
    """At 151,936 tokens most noise is left unfinished (only tokens that could still win are scored): the token is
    the argmax of every token's score all the same, on flat, peaked, tied and near-greedy rows."""
    vocab = 151_936
    rng = np.random.default_rng(5)
    flat, peaked = rng.normal(0, 1, vocab), rng.normal(0, 3, vocab)
    peaked[77] += 30
    spiky = np.full(vocab, -np.inf)
    spiky[rng.integers(0, vocab, 50)] = rng.normal(0, 1, 50)
    tied = rng.integers(-2, 1, vocab) / 4
    logits = np.stack([flat, peaked, spiky, tied, np.zeros(vocab), *rng.normal(0, 2, (20, vocab))]).astype(np.float32)
    for temperature in (1e-6, 0.7, 1.0, 3.0):
        params = SamplingParams(temperature, seed=2024)
        positions = np.array([0, 1, 1, 9, 40, *range(100, 120)])
        want = [int(np.argmax(((row - row.max()) / np.float32(temperature)).astype(np.float64) +
                              gumbel(2024, np.array([p]), np.arange(vocab))))
                for row, p in zip(logits, positions)]
        assert sample(logits, positions, params).tolist() == want, temperature


def test_truncation_that_keeps_everything_changes_nothing():
    """The whole-row path and the truncating path score the same tokens identically."""
    logits = np.tile(rows(40)[6:12], (300, 1))
    positions = np.arange(len(logits))
    plain = sample(logits, positions, SamplingParams(1.3, seed=21))
    assert len(set(plain.tolist())) > 20
    for params in (SamplingParams(1.3, min_p=1e-30, seed=21), SamplingParams(1.3, top_p=1 - 1e-12, seed=21)):
        assert np.array_equal(sample(logits, positions, params), plain)


def test_cuts_at_exact_boundaries():
    """Top-p stops at the first prefix whose mass reaches top_p; min-p keeps a weight equal to min_p."""
    even = np.zeros((400, 4), np.float32)
    nucleus = sample(even, np.arange(400), SamplingParams(1.0, top_p=0.5, seed=2))
    assert set(nucleus.tolist()) == {0, 1}
    half = np.float32(math.log(0.5))
    row = np.tile(np.array([0.0, half, half, half - 1], np.float32), (400, 1))
    assert set(sample(row, np.arange(400), SamplingParams(1.0, min_p=0.5, seed=2)).tolist()) == {0, 1, 2}


def test_a_nucleus_in_a_long_tail_is_not_cut_short():
    """A top token with 40% of the mass and 30,000 tokens far below it: top-p 0.6 keeps about 10,000 of them."""
    row = np.full(30_000, math.log(5e-5), np.float32)
    row[0] = 0
    params = SamplingParams(1.0, top_p=0.6, seed=6)
    kept = kept_tokens(row, params)
    drawn = sample(np.tile(row, (300, 1)), np.arange(300), params)
    assert 9_000 < len(kept) < 11_000 and set(drawn.tolist()) <= set(kept)
    assert 50 < (drawn != 0).sum() < 150  # the tail holds a third of the nucleus


def test_every_tree_node_at_a_depth_shares_its_position_noise():
    """Rows with the same logits at the same position sample the same token; moving one row changes only it."""
    logits, params = np.repeat(rows(64)[7:8], 4, axis=0), SamplingParams(1.0, seed=3)
    tokens = sample(logits, np.array([10, 10, 10, 10]), params)
    assert len(set(tokens.tolist())) == 1
    shifted = [sample(logits[:1], np.array([p]), params)[0] for p in range(11, 40)]
    assert set(shifted) - {tokens[0]}


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """The upper tail of a chi-square statistic (Wilson-Hilferty's normal approximation)."""
    stat, dof = float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=11), SamplingParams(0.8, top_k=9, seed=12),
                                    SamplingParams(1.2, top_p=0.75, seed=13), SamplingParams(0.9, min_p=0.08, seed=14),
                                    SamplingParams(0.7, top_k=15, top_p=0.9, min_p=0.02, seed=15)], ids=str)
def test_frequencies_follow_the_tempered_truncated_softmax(params):
    draws = 20_000
    row = np.random.default_rng(7).normal(0, 1, 30).astype(np.float32)
    tokens = sample(np.repeat(row[None], draws, axis=0), np.arange(draws), params)
    kept = kept_tokens(row, params)
    assert set(tokens.tolist()) <= set(kept)
    weight = np.exp((row[kept] - row.max()) / params.temperature).astype(np.float64)
    counts = np.bincount(tokens, minlength=len(row))[kept]
    assert chi_square_p(counts, draws * weight / weight.sum()) > 0.001
    if params.top_k or params.top_p < 1 or params.min_p:
        assert len(kept) < len(row)


def test_seeds_differ_where_the_distribution_is_wide():
    logits = np.repeat(np.random.default_rng(1).normal(0, 0.5, (1, 40)).astype(np.float32), 200, axis=0)
    one, two = (sample(logits, np.arange(200), SamplingParams(1.0, seed=s)) for s in (1, 2))
    assert len(set(one.tolist())) > 10 and (one != two).mean() > 0.5


def test_greedy_is_argmax_and_the_low_temperature_limit():
    logits = np.array([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0], [-2.0, -2.0, -3.0, -1.9]], np.float32)
    greedy = sample(logits, np.zeros(3, np.int64), SamplingParams())
    assert greedy.tolist() == [1, 0, 3] == np.argmax(logits, axis=1).tolist()
    for params in (SamplingParams(1.0, top_k=1, seed=4), SamplingParams(1.0, top_p=1e-9, seed=4)):
        assert sample(np.tile(logits, (50, 1)), np.arange(150), params).tolist() == greedy.tolist() * 50
    distinct = np.random.default_rng(2).permutation(100).astype(np.float32)[None] / 10  # gaps of 0.1
    cold = sample(np.repeat(distinct, 300, axis=0), np.arange(300), SamplingParams(1e-3, seed=5))
    assert set(cold.tolist()) == {int(np.argmax(distinct))}


def test_logprobs_are_the_untempered_log_softmax():
    logits = np.array([[1.0, 3.0, 3.0, 0.0, -2.0, 3.0], [0.0] * 6], np.float32)
    exact = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    out = logprobs(logits, np.array([4, 2]), top_n=4)
    np.testing.assert_allclose(out.chosen, exact[[0, 1], [4, 2]], rtol=1e-6)
    assert out.top_ids.tolist() == [[1, 2, 5, 0], [0, 1, 2, 3]]
    np.testing.assert_allclose(out.top, np.take_along_axis(exact, out.top_ids, axis=1), rtol=1e-6)
    wide = rows(2000)
    top = logprobs(wide, np.zeros(len(wide), np.int64), top_n=MAX_TOP_N).top_ids
    assert top.tolist() == [sorted(range(2000), key=lambda t: (-r[t], t))[:MAX_TOP_N] for r in wide]
    assert logprobs(logits, np.array([0, 0])).top_ids.shape == (2, 0)


@pytest.mark.parametrize("fields, name", [
    ({"temperature": -0.5}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": 1e-9}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"), ({"min_p": 1.0}, "min_p"),
    ({"min_p": -0.1}, "min_p"), ({"seed": -1}, "seed"), ({"seed": SEED_LIMIT}, "seed"), ({"seed": 1.5}, "seed")])
def test_bad_parameters_are_one_line_naming_the_field(fields, name):
    with pytest.raises(InputError) as caught:
        SamplingParams(**fields).check()
    message = str(caught.value)
    assert message.startswith(f"{name} ") and "\n" not in message and f"pass {name}" in message


def test_bad_calls_are_one_line():
    logits, params = rows(40), SamplingParams(1.0, seed=1)
    refusals = [(lambda: sample(logits, np.arange(3), params), "positions"),
                (lambda: sample(logits, -np.ones(len(logits), np.int64), params), "positions"),
                (lambda: sample(logits, np.arange(len(logits)), SamplingParams(1.0)), "seed"),
                (lambda: sample(logits[0], np.arange(1), params), "logits"),
                (lambda: sample(logits[0], np.arange(1), SamplingParams()), "logits"),
                (lambda: logprobs(logits, np.full(len(logits), 40), 1), "tokens"),
                (lambda: logprobs(logits, np.zeros(len(logits), np.int64), MAX_TOP_N + 1), "top_n")]
    for call, word in refusals:
        with pytest.raises(InputError, match=word) as caught:
            call()
        assert "\n" not in str(caught.value)
    broken = logits.copy()
    broken[3, 5] = np.nan
    with pytest.raises(GlanceError, match="row 3"):
        sample(broken, np.arange(len(logits)), params)


def test_seeds_are_kept_or_drawn():
    params = SamplingParams(0.7, top_p=0.9)
    drawn = params.seeded()
    assert drawn.seed is not None and 0 <= drawn.seed < SEED_LIMIT and drawn.seeded() is drawn
    assert drawn.top_p == 0.9 and params.with_seed(17).seed == 17 and not drawn.greedy and SamplingParams().greedy


def test_top_p_weighs_every_token_top_k_keeps_even_those_min_p_drops():
    """top-p's share is of the tokens top-k left, before min-p: 22 tokens too unlikely for min-p still count in its
    total, so the likeliest token alone (a quarter of it) does not reach top-p and the second is kept too. Alone
    and in a batch whose other row keeps many tokens, as the documented rule says."""
    temperature = np.float32(2.5)
    row = np.full(2000, -1e4, np.float32)
    row[7], row[900] = 0.0, temperature * np.log(np.float32(0.85))
    row[100:122] = temperature * np.log(np.float32(0.1))
    params = SamplingParams(float(temperature), top_p=0.3125, top_k=24, min_p=0.25, seed=5)
    positions = np.arange(200)
    expected = [sample_one(row, int(p), params) for p in positions]
    assert set(expected) == {7, 900}
    assert sample(np.tile(row, (200, 1)), positions, params).tolist() == expected
    alone = [int(sample(row[None], np.array([p]), params)[0]) for p in positions[:40]]
    assert alone == expected[:40]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, SEED_LIMIT - 1), temperature=st.floats(1e-6, 100.0), top_p=st.floats(1e-9, 1.0),
       top_k=st.integers(0, 80), min_p=st.floats(0.0, 0.999), vocab=st.sampled_from([40, 600, 3000]),
       spread=st.floats(0.1, 6.0), peak=st.floats(0.0, 12.0), data=st.integers(0, 2**31))
def test_any_settings_follow_the_rule_alone_and_in_a_batch(seed, temperature, top_p, top_k, min_p, vocab, spread, peak,
                                                           data):
    """Any combination of truncations on peaked to flat rows: every row samples the documented rule's token, in a
    batch with rows unlike it and alone (whichever of the whole-row and compacted paths the batch takes)."""
    params = SamplingParams(temperature, top_p, top_k, min_p, seed).check()
    rng = np.random.default_rng(data)
    logits = rng.normal(0, spread, (4, vocab)).astype(np.float32)
    logits[0, rng.integers(vocab)] += peak
    logits[3] = np.round(logits[3])  # ties at the cuts
    positions = rng.integers(0, 50, 4)
    expected = [sample_one(row, int(p), params) for row, p in zip(logits, positions)]
    assert sample(logits, positions, params).tolist() == expected
    assert [int(sample(logits[i:i + 1], positions[i:i + 1], params)[0]) for i in range(4)] == expected


def test_the_least_positive_min_p_is_a_setting_not_a_crash():
    """min_p 5e-324 (the least positive double) halved is 0: the floor is taken in logs, so it keeps all but -inf."""
    row = np.linspace(-3, 3, 40, dtype=np.float32)
    params = SamplingParams(1.0, min_p=5e-324, seed=2)
    assert sample(row[None], np.array([3]), params).tolist() == [sample_one(row, 3, params)]
