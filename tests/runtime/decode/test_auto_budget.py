"""`--budget auto`'s pieces on numbers alone: cost profiles, node calibration and the per-round rule.

Profiles and calibrations are built from numbers, and each decision is checked against the same rule
computed here from scratch (closed-form costs, a plain loop over tree sizes), so a change to the rule or
to how costs are read shows up as a disagreement, not as a different but plausible choice.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dataclasses import replace

from glance_runtime.decode.auto_budget import DEPTH_SLACK, AutoBudget
from glance_runtime.decode.calibration import FILE, PRIOR, Calibration, find_calibration, load_calibration, path_logit
from glance_runtime.decode.cost_profile import CostProfile, load, measurable_rows, profile_path, row_grid, save
from glance_runtime.decode.cost_watch import CONFIRM, EVERY, CostWatch
from glance_runtime.decode.loop import RoundLog
from glance_runtime.formats import cost as cost_format
from glance_runtime.errors import GlanceError
from glance_runtime.decode.tree import Tree, build_tree

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

GRID = (1, 2, 4, 8, 16, 32, 64)


def gpu_ms(rows: float) -> float:
    """A GPU-like verify: flat until 16 rows, then a gentle slope (exact at and between GRID's points)."""
    return 1.0 + max(rows - 16, 0) * 0.01


def cpu_ms(rows: float) -> float:
    """A CPU-like verify: every row costs a quarter of the first."""
    return 0.75 + 0.25 * rows


def profile(verify: list[float] | tuple[float, ...], draft_ms: float, rows: tuple[int, ...] = GRID) -> CostProfile:
    return CostProfile(device="test", rows=rows, verify_ms=tuple(verify), draft_ms=draft_ms, repeats=5,
                       measured_at="2026-01-01T00:00:00")


GPU = profile([gpu_ms(r) for r in GRID], draft_ms=0.5)
CPU = profile([cpu_ms(r) for r in GRID], draft_ms=1.0)


def random_draft(seed: int, offsets: int = 7, k: int = 8, spread: float = 2.5) -> tuple[np.ndarray, np.ndarray]:
    """A random draft's top-k ids and log-probs (best first per offset)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, spread, size=(offsets, 40))
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return np.tile(np.arange(k), (offsets, 1)), np.sort(logp, axis=1)[:, ::-1][:, :k].copy()


def best_first_tree(seed: int, offsets: int = 7, k: int = 8, budget: int = 63) -> Tree:
    """A best-first tree from a random draft."""
    return build_tree(5, *random_draft(seed, offsets, k), budget)


def best_first_scores(seed: int, budget: int = 63) -> np.ndarray:
    return best_first_tree(seed, budget=budget).scores[1:]


# --- cost profiles ----------------------------------------------------------------------------------------

def test_verify_cost_interpolates_between_measured_rows():
    p = profile([1.0, 2.0, 5.0], draft_ms=1.0, rows=(1, 4, 16))
    np.testing.assert_allclose(p.verify_cost(np.array([1, 2, 4, 10, 16])), [1.0, 4 / 3, 2.0, 3.5, 5.0])
    assert float(p.verify_cost(2)) == pytest.approx(4 / 3)


def test_verify_cost_never_falls_as_rows_grow():
    """A noisy measurement (2 rows timed dearer than 4) is taken at the larger count's cost (the running minimum
    from above: other processes only add time), so no bigger tree looks cheaper and no noisy count dearer."""
    p = profile([1.0, 3.0, 2.0, 4.0], draft_ms=1.0, rows=(1, 2, 4, 8))
    np.testing.assert_allclose(p.verify_cost(np.array([2, 3, 4, 6])), [2.0, 2.0, 2.0, 3.0])
    costs = p.verify_cost(np.arange(1, 40))
    assert np.all(np.diff(costs) >= 0)
    bad = profile([1.01, 1.14, 8.18, 8.18, 29.9, 14.5, 64.3], draft_ms=1.0)
    np.testing.assert_allclose(bad.monotone_ms(), [1.01, 1.14, 8.18, 8.18, 14.5, 14.5, 64.3])


def test_verify_cost_extends_past_the_last_row_at_its_slope():
    p = profile([1.0, 3.0, 2.0, 4.0], draft_ms=1.0, rows=(1, 2, 4, 8))
    np.testing.assert_allclose(p.verify_cost(np.array([8, 12, 16])), [4.0, 6.0, 8.0])  # (4 - 2) / (8 - 4) a row
    flat_end = profile([1.0, 2.0, 2.0], draft_ms=1.0, rows=(1, 2, 4))
    assert float(flat_end.verify_cost(100)) == pytest.approx(2.0)
    single = profile([1.5], draft_ms=1.0, rows=(1,))
    np.testing.assert_allclose(single.verify_cost(np.array([1, 10])), [1.5, 1.5])


def test_verify_cost_of_linear_profiles_is_exact():
    """What the brute-force checks below rely on: these profiles read back the function they were made from."""
    rows = np.arange(1, 100)
    np.testing.assert_allclose(GPU.verify_cost(rows), [gpu_ms(r) for r in rows])
    np.testing.assert_allclose(CPU.verify_cost(rows), [cpu_ms(r) for r in rows])


def test_profile_round_trips_through_its_file(tmp_path):
    path = tmp_path / "sub" / "cost-profile-x.json"
    save(CPU, path)
    assert load(path) == CPU
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing temporary left beside it
    assert "draft pass + tree: 1.00 ms" in CPU.table() and len(CPU.table().splitlines()) == 3 + len(GRID)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(format="glance-other"), "not a glance-cost"),
    (lambda d: d.update(format_version=4), "not a glance-cost"),
    (lambda d: d.update(draft_depths=[1, 4], draft_share=[0.5]), "one draft_share each"),
    (lambda d: d.update(draft_depths=[4, 1], draft_share=[0.5, 1.0]), "draft_depths must ascend"),
    (lambda d: d.update(draft_depths=[1, 4], draft_share=[0.5, 0.9]), "ending at 1"),
    (lambda d: d.update(draft_depths=[1, 4], draft_share=[0.0, 1.0]), "fractions"),
    (lambda d: d.update(draft_depths=[1, 4], draft_share=[1.5, 1.0]), "fractions"),
    (lambda d: d.update(spread=[0.1]), "spread"),
    (lambda d: d.update(load_average=-1), "load_average"),
    (lambda d: d.update(provisional=1), "provisional"),
    (lambda d: d.update(rows=[2, 4], verify_ms=[1.0, 2.0]), "ascend from 1"),
    (lambda d: d.update(rows=[1, 4, 2], verify_ms=[1.0, 2.0, 3.0]), "ascend from 1"),
    (lambda d: d.update(rows=[1, 2, 2], verify_ms=[1.0, 2.0, 3.0]), "ascend from 1"),
    (lambda d: d.update(rows=[1, 2], verify_ms=[1.0]), "one verify time each"),
    (lambda d: d.update(rows=[], verify_ms=[]), "ascend from 1"),
    (lambda d: d.update(verify_ms=[0.0, *d["verify_ms"][1:]]), "positive"),
    (lambda d: d.update(draft_ms=-1.0), "positive"),
])
def test_profile_from_dict_refuses_what_cannot_be_costs(change, message):
    raw = CPU.as_dict()
    assert CostProfile.from_dict(raw) == CPU
    change(raw)
    with pytest.raises(ValueError, match=message):
        CostProfile.from_dict(raw)


def test_a_damaged_or_missing_profile_reads_as_none(tmp_path):
    """None means 'measure again'; a refusal here would leave a damaged file blocking auto for good."""
    assert load(tmp_path / "absent.json") is None
    for i, text in enumerate(["{", "", "[]", json.dumps({**CPU.as_dict(), "rows": [2]}),
                              json.dumps({k: v for k, v in CPU.as_dict().items() if k != "draft_ms"})]):
        (tmp_path / f"{i}.json").write_text(text)
        assert load(tmp_path / f"{i}.json") is None, text


@pytest.mark.parametrize("largest,grid", [(1, [1]), (2, [1, 2]), (40, [1, 2, 4, 8, 16, 32, 40]),
                                          (64, list(GRID))])
def test_row_grid_doubles_up_to_the_largest(largest, grid):
    assert row_grid(largest) == grid


def test_measurable_rows_is_what_one_draft_can_fill():
    assert measurable_rows(block_size=4, branch_k=2, max_rows=64) == 1 + 2 + 4 + 8
    assert measurable_rows(block_size=8, branch_k=8, max_rows=64) == 64
    assert measurable_rows(block_size=2, branch_k=1, max_rows=64) == 2


def test_profile_path_is_per_device_beside_the_artifacts_else_in_the_cache(tmp_path):
    here = profile_path(tmp_path, "served", "device A")
    assert here.parent == tmp_path and here.name.startswith("cost-profile-") and here.suffix == ".json"
    assert profile_path(tmp_path, "served", "device B") != here
    cached = profile_path(None, "served", "device A")
    assert cached.parent.name == "cost" and cached.name.endswith(here.name.split("-")[-1])
    assert profile_path(None, "other", "device A") != cached


# --- calibration ------------------------------------------------------------------------------------------

def test_prior_is_the_drafts_own_path_probability():
    scores = np.array([-1e-6, -0.1, -0.7, -2.0, -9.0])
    for surprisal in (None, 0.0, 3.0):
        np.testing.assert_allclose(PRIOR.node_probability(scores, surprisal), np.exp(scores), rtol=1e-6)
    assert not PRIOR.fitted and PRIOR.offset_acceptance(1.0) is None


@pytest.mark.parametrize("calibration", [PRIOR, Calibration(a=0.5, b=0.7, c=-0.3, d=-0.4, surprisal_mean=0.8)])
def test_node_scorer_is_node_probability_one_node_at_a_time(calibration):
    tree = best_first_tree(1)
    for surprisal in (None, 0.0, 1.7):
        q = calibration.node_scorer(surprisal)
        one_by_one = [q(s, d) for s, d in zip(tree.scores[1:].tolist(), tree.depths[1:].tolist())]
        np.testing.assert_allclose(one_by_one, calibration.node_probability(tree.scores[1:], surprisal,
                                                                            tree.depths[1:]), rtol=1e-12)


def test_path_logit_is_the_logit_of_the_path_probability():
    s = np.array([-0.01, -0.5, -3.0])
    p = np.exp(s)
    np.testing.assert_allclose(path_logit(s), np.log(p / (1 - p)))
    assert np.isfinite(path_logit(np.array([0.0]))).all()  # a certain path still has a finite logit


@pytest.mark.parametrize("calibration", [PRIOR, Calibration(a=0.8, b=0.6, c=-0.4), Calibration(a=-2.0, b=2.5, c=0.3),
                                         Calibration(a=1.0, b=0.0, c=0.0)])
@pytest.mark.parametrize("seed", range(4))
def test_node_probabilities_never_rise_along_a_best_first_tree(calibration, seed):
    """Without a depth term, the packed (best-first) order is also the order of q."""
    scores = best_first_scores(seed)
    assert len(scores) == 63
    for surprisal in (None, 0.2, 2.5):
        q = calibration.node_probability(scores, surprisal)
        assert np.all((q >= 0) & (q <= 1)) and np.all(np.diff(q) <= 1e-15)


@pytest.mark.parametrize("calibration", [Calibration(a=0.5, b=0.8, d=-0.4), Calibration(b=1.3, c=0.2, d=-1.5),
                                         Calibration(a=1.0, b=0.0, d=-0.1)])
@pytest.mark.parametrize("seed", range(4))
def test_node_probabilities_never_rise_down_a_path(calibration, seed):
    """With a depth term, a child is never likelier than its parent (the packed order may then interleave)."""
    tree = best_first_tree(seed)
    for surprisal in (None, 1.0):
        q = calibration.node_probability(tree.scores[1:], surprisal, tree.depths[1:])
        child_parent = [(q[i - 1], q[tree.parents[i] - 1]) for i in range(1, tree.size) if tree.parents[i] > 0]
        assert child_parent and all(child <= parent for child, parent in child_parent)
        shallow = calibration.node_probability(tree.scores[1:], surprisal)
        assert np.all(q <= shallow) and np.any(q < shallow)


def test_first_round_uses_the_mean_surprisal():
    cal = Calibration(c=-0.5, surprisal_mean=2.0)
    scores = np.array([-0.2, -1.0])
    np.testing.assert_allclose(cal.node_probability(scores, None), cal.node_probability(scores, 2.0))
    per_node = cal.node_probability(scores, np.array([np.nan, 0.0]))
    assert per_node[0] == pytest.approx(cal.node_probability(scores[:1], 2.0)[0])
    assert per_node[1] == pytest.approx(cal.node_probability(scores[1:], 0.0)[0])


def test_law_gives_offset_acceptance_only_once_the_anchor_is_known():
    law = Calibration(law=(2.0, 1.5))
    assert law.offset_acceptance(None) is None
    assert law.offset_acceptance(0.0) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert law.offset_acceptance(3.0) == pytest.approx(1 / (1 + math.exp(2.5)))


def test_calibration_round_trips_and_refuses_bad_coefficients():
    good = Calibration(a=0.3, b=1.2, c=-0.1, d=-0.2, law=(1.0, 0.5), surprisal_mean=0.7, fitted_on={"rounds": 10})
    assert Calibration.from_dict(good.as_dict()) == good
    assert Calibration.from_dict(PRIOR.as_dict()) == PRIOR
    for change, error in [(lambda d: d.update(format="glance-cost"), ValueError),
                          (lambda d: d.update(format_version=0), ValueError),
                          (lambda d: d["node"].update(b=-0.5), ValueError),
                          (lambda d: d["node"].update(d=0.5), ValueError),
                          (lambda d: d["node"].update(a=float("nan")), ValueError),
                          (lambda d: d["law"].update(b1=float("inf")), ValueError),
                          (lambda d: d["node"].pop("c"), KeyError)]:
        raw = good.as_dict()
        change(raw)
        with pytest.raises(error):
            Calibration.from_dict(raw)


def test_load_calibration_refuses_in_one_line(tmp_path):
    with pytest.raises(GlanceError, match="absent.json does not exist"):
        load_calibration(tmp_path / "absent.json")
    bad = tmp_path / FILE
    bad.write_text(json.dumps({**PRIOR.as_dict(), "node": {"a": 0, "b": -1, "c": 0}}))
    with pytest.raises(GlanceError, match="not a usable calibration.*glance-bench calibrate") as err:
        load_calibration(bad)
    assert "\n" not in str(err.value)
    bad.write_text("[]")  # valid JSON, not a calibration
    with pytest.raises(GlanceError, match="not a usable calibration"):
        load_calibration(bad)


def test_node_probability_saturates_without_overflow():
    """Extreme logits give 0 or 1 quietly (a warning on stderr would break glance-run's one-line output)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = Calibration(c=-5.0).node_probability(np.array([-0.1, -3.0]), 200.0)
        q_high = Calibration(a=800.0).node_probability(np.array([-0.1]), None)
    assert np.all(q >= 0) and np.all(q < 1e-300) and q_high[0] == 1.0


def test_a_tree_of_one_row_never_drafts_even_with_a_law():
    """--max-tree 1 leaves no room for a drafted node: the law's chain is empty, so no round drafts."""
    policy = AutoBudget(CPU, Calibration(law=(5.0, 0.0)), max_nodes=0, block_size=8)
    assert not policy.should_draft(0.1)


def test_find_calibration_takes_the_first_place_that_has_one(tmp_path):
    empty, first, second = (tmp_path / n for n in ("empty", "first", "second"))
    for place in (empty, first, second):
        place.mkdir()
    Calibration(a=1.0).save(first / FILE)
    Calibration(a=2.0).save(second / FILE)
    found, path = find_calibration([None, empty, first, second])
    assert (found.a, path) == (1.0, first / FILE)
    found, path = find_calibration([second, first])
    assert (found.a, path) == (2.0, second / FILE)
    assert find_calibration([None, empty]) == (PRIOR, None)
    assert find_calibration([]) == (PRIOR, None)


# --- the per-round rule -----------------------------------------------------------------------------------

def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def brute_should_draft(verify_ms, draft_ms: float, p: float, depth: int) -> bool:
    """Step 1 from the docstring: some chain of m nodes beats a plain greedy step's one token per V(1)."""
    rates = [sum(p ** i for i in range(m + 1)) / (draft_ms + verify_ms(m + 1)) for m in range(1, depth + 1)]
    return max(rates) > 1 / verify_ms(1)


def brute_grow(verify_ms, draft_ms: float, ids: np.ndarray, logp: np.ndarray, calibration: Calibration,
               surprisal: float | None, max_nodes: int) -> Tree:
    """Step 2 from the docstring, without its early stop: every node up to max_nodes grown in falling q
    (q computed here, with no numpy), then the earliest n maximising E(n) / (D + V(n + 1))."""
    cal = calibration
    u = cal.surprisal_mean if surprisal is None else surprisal

    def q(score: float, depth: int) -> float:
        p = math.exp(min(score, -1e-12))
        return sigmoid(cal.a + cal.b * math.log(p / (1 - p)) + cal.d * depth + cal.c * u)

    full = build_tree(5, ids, logp, max_nodes, priority=q)
    probabilities = [q(s, d) for s, d in zip(full.scores[1:].tolist(), full.depths[1:].tolist())]
    best, best_rate = 0, -1.0
    for n in range(len(probabilities) + 1):
        rate = (1 + sum(probabilities[:n])) / (draft_ms + verify_ms(n + 1))
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = n, rate
    return full.prefix(best + 1)


def test_no_law_or_first_round_always_drafts():
    costly = profile([cpu_ms(r) for r in GRID], draft_ms=50.0)
    assert AutoBudget(costly, PRIOR, 63, 8).should_draft(5.0)
    assert AutoBudget(costly, Calibration(law=(-5.0, 3.0)), 63, 8).should_draft(None)


def test_a_law_without_surprisal_decides_the_same_every_round():
    flat = profile([1.0] * len(GRID), draft_ms=2.0)
    never = AutoBudget(flat, Calibration(law=(-3.0, 0.0)), 63, 8)  # p = 0.05 whatever the anchor
    assert not any(never.should_draft(u) for u in (0.0, 1.0, 9.0, None))  # the first round too
    always = AutoBudget(flat, Calibration(law=(3.0, 0.0)), 63, 8)  # p = 0.95
    assert all(always.should_draft(u) for u in (0.0, 1.0, 9.0))


def test_skips_the_draft_when_acceptance_is_unlikely_and_drafting_costly():
    law = Calibration(law=(3.0, 2.0))  # p = 0.95 at u = 0, 0.05 at u = 3
    costly = AutoBudget(profile([1.0] * len(GRID), draft_ms=2.0), law, 63, 8)
    assert not costly.should_draft(3.0) and costly.should_draft(0.0)
    cheap = AutoBudget(profile([1.0] * len(GRID), draft_ms=0.01), law, 63, 8)
    assert cheap.should_draft(3.0), "a nearly free draft repays even a 5% chance"


@pytest.mark.parametrize("cost,name", [(GPU, "gpu"), (CPU, "cpu"), (profile([cpu_ms(r) for r in GRID], 1.5), "slow")])
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_should_draft_matches_the_rule_computed_here(cost, name, block_size):
    verify = gpu_ms if name == "gpu" else cpu_ms
    law = Calibration(law=(3.0, 1.0))
    decisions = set()
    for u in np.linspace(0, 6, 25):
        p = sigmoid(3.0 - u)
        expected = brute_should_draft(verify, cost.draft_ms, p, min(block_size - 1, 63))
        assert AutoBudget(cost, law, 63, block_size).should_draft(float(u)) == expected, (u, p)
        decisions.add(expected)
    if name == "slow" and block_size >= 4:
        assert decisions == {True, False}, "the sweep must cross the point where drafting stops paying"


def test_grow_keeps_more_nodes_where_rows_are_cheap():
    ids, logp = random_draft(0)
    on_gpu = AutoBudget(GPU, PRIOR, 63, 8).grow(5, ids, logp, 8, 0.5).size
    on_cpu = AutoBudget(CPU, PRIOR, 63, 8).grow(5, ids, logp, 8, 0.5).size
    assert on_gpu - 1 > 2 * (on_cpu - 1) > 0


def test_grow_can_keep_no_node():
    """Hopeless nodes on a steep device: the draft has run, but verifying any node costs more than it yields."""
    hopeless = np.array([[-4.0], [-5.0], [-6.0], [-7.0]])
    tree = AutoBudget(CPU, PRIOR, 63, 8).grow(5, np.zeros((4, 1), np.int64), hopeless, 1, None)
    assert tree.size == 1 and tree.tokens[0] == 5


def test_grow_builds_nothing_below_a_stop_token():
    """A confident chain whose third token ends the answer: auto keeps the stop token and nothing below it."""
    ids = np.tile(np.arange(8), (15, 1))
    sure = np.full((15, 8), -1e-4)
    sure[:, 1:] = -12.0  # only the first column is worth a row
    ids[2] = [7, 0, 1, 2, 3, 4, 5, 6]
    whole = AutoBudget(GPU, PRIOR, 63, 16).grow(5, ids, sure, 8, 0.0)
    ended = AutoBudget(GPU, PRIOR, 63, 16).grow(5, ids, sure, 8, 0.0, leaves=frozenset({7}))
    assert whole.depths.max() > 3 and 7 in whole.tokens[whole.depths == 3]
    assert ended.depths.max() == 3 and ended.tokens[ended.depths == 3].tolist() == [7]


def test_grow_never_exceeds_max_nodes():
    ids = np.tile(np.arange(8), (15, 1))
    sure = np.full((15, 8), -1e-4)
    for max_nodes in (0, 1, 7, 63):
        assert AutoBudget(GPU, PRIOR, max_nodes, 16).grow(5, ids, sure, 8, 0.0).size == max_nodes + 1
        assert AutoBudget(CPU, PRIOR, max_nodes, 16).grow(5, ids, sure, 8, 0.0).size == max_nodes + 1


CALIBRATIONS = [PRIOR, Calibration(a=0.5, b=0.7, c=-0.3), Calibration(a=-1.0, b=1.5, c=0.2, law=(1.0, 1.0)),
                Calibration(a=2.0, b=0.0, c=-1.0), Calibration(a=1.0, b=0.9, d=-0.3, surprisal_mean=1.0),
                Calibration(a=0.2, b=0.55, d=-0.3)]


@pytest.mark.parametrize("seed", range(6))
def test_grow_matches_the_rule_computed_here(seed):
    """The early stop never changes the answer: the same tree as growing every node and taking the argmax."""
    ids, logp = random_draft(seed, offsets=9, spread=1.5 + seed)
    sizes = set()
    for calibration in CALIBRATIONS:
        for verify, draft_ms in ((gpu_ms, 0.5), (cpu_ms, 1.0), (cpu_ms, 0.1), (lambda r: 0.2 + 0.4 * r, 3.0)):
            cost = profile([verify(r) for r in GRID], draft_ms)
            for surprisal in (None, 0.3, 2.0):
                for max_nodes in (63, 20):
                    tree = AutoBudget(cost, calibration, max_nodes, 10).grow(5, ids, logp, 8, surprisal)
                    want = brute_grow(verify, draft_ms, ids, logp, calibration, surprisal, max_nodes)
                    for name in ("tokens", "parents", "depths", "scores"):
                        np.testing.assert_array_equal(getattr(tree, name), getattr(want, name))
                    sizes.add(tree.size)
    assert len(sizes) >= 5, f"the settings must lead to different trees, not only {sorted(sizes)}"


# --- plausibility, and costs learned from the decode's own rounds ------------------------------------------

BUSY = profile([1.01, 1.14, 8.18 * 5.05 / 8.18, 8.18, 29.9, 14.5, 64.3], draft_ms=0.98)  # measured on a busy machine


def true_ms(rows: float) -> float:
    """The device these tests decode on: a CPU-like verify, 8 rows at 1.4x one row, 64 at 4.2x."""
    return 1.0 + 0.05 * rows


def test_a_version_1_profile_still_reads(tmp_path):
    raw = {k: v for k, v in CPU.as_dict().items() if k not in ("checked_rows", "spread", "load_average", "provisional")}
    raw["format_version"] = 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    assert load(path) == CPU and CPU.checked_rows == () and CPU.spread == () and not CPU.provisional
    assert CostProfile.from_dict({**raw, "checked_rows": [2, 1]}).checked_rows == (1, 2)
    with pytest.raises(ValueError, match="checked_rows"):
        CostProfile.from_dict({**raw, "checked_rows": [0]})
    path.write_text(json.dumps({**raw, "format_version": 4}))
    with pytest.raises(GlanceError, match="v4.*it reads glance-cost v1-v3.*--remeasure") as err:
        cost_format.read(path)
    assert "\n" not in str(err.value)


def test_doubts_name_rows_dearer_than_that_many_single_rows():
    assert GPU.doubts() == [] and CPU.doubts() == []
    poisoned = profile([1.0, 6.0, 3.0, 6.5], draft_ms=1.0, rows=(1, 2, 4, 8))
    assert poisoned.doubts() == ["a 2-row verify timed at 6.0x one row, more than 1.5 x 2 rows' worth"]
    assert "implausible" not in CPU.table()


def test_problems_name_disorder_spread_and_doubt():
    """What `glance-bench cost` flags: a larger tree timed cheaper than a smaller one, repeats spread widely (with
    the load average they were measured at), a provisional profile; nothing on a clean one."""
    assert CPU.problems() == [] and GPU.problems() == []
    assert BUSY.disorder() == ["32 rows timed at 14.50 ms, cheaper than 16 rows' 29.90 ms"]
    wide = replace(CPU, spread=(0.02, 0.03, 0.9, 0.1, 0.1, 0.1, 0.1), load_average=4.5)
    assert wide.problems() == ["repeats spread widely above their fastest (4 rows 90%, load average 4.50)"]
    assert "spread" in wide.table() and "load average 4.50" in wide.table()
    assert replace(CPU, provisional=True).problems()[0].startswith("measured under doubt (provisional)")


class Rounds:
    """Feeds a policy rounds whose verify costs follow `ms(rows)` (and a draft of `draft_ms`), as the loop does,
    times `noise(round)` (at least 1: other processes only add time), in decodes of DECODE rounds (each ended as
    the loop ends one: the policy settles); records each round's tree size, the size the rule picked from the
    costs it held at the time, and every profile stored."""

    DECODE = 8

    def __init__(self, stored: CostProfile, ms, draft_ms: float, law: tuple[float, float] = (3.0, 0.0),
                 noise=lambda _: 1.0):
        self.saved: list[CostProfile] = []
        calibration = Calibration(law=law)
        self.policy = AutoBudget(stored, calibration, 63, 16, CostWatch(stored, self.saved.append, 64, 15))
        self.ms, self.draft_ms, self.noise = ms, draft_ms, noise
        self.sizes: list[int] = []
        self.picked: list[int] = []
        self.drafted: list[bool] = []

    def run(self, n: int) -> list[int]:
        for _ in range(n):
            seed = len(self.sizes)
            draft = random_draft(seed, offsets=15, spread=4.0)
            rule = AutoBudget(self.policy.watch.used, self.policy.calibration, 63, 16)
            self.picked.append(rule.grow(5, *draft, 8, None).size if rule.should_draft(None) else 1)
            drafted = self.policy.should_draft(None)
            tree = self.policy.grow(5, *draft, 8, None) if drafted else Tree.root(5)
            slow = self.noise(seed)
            verify_ms, draft_ms = self.ms(tree.size) * slow, self.draft_ms * slow if drafted else 0.0
            self.policy.observe(RoundLog(entropy=0.1, accepted=1, tree_size=tree.size, draft_ms=draft_ms,
                                         verify_ms=verify_ms, total_ms=draft_ms + verify_ms, drafted=drafted))
            self.sizes.append(tree.size)
            self.drafted.append(drafted)
            if len(self.sizes) % self.DECODE == 0:
                self.policy.settle()
        self.policy.settle()
        return self.sizes


def test_a_busy_profile_is_learned_past_within_a_few_rounds():
    """The profile a busy moment wrote (cheap 1-2 rows, 4+ rows 5-60x one row; 1 and 2 rows already checked, as
    the decode that checked only those left it): auto never drafts on it, yet the decode's own rounds explore
    4 rows, find them cheap, and verify trees from the fourth round on; what is stored is monotone and near
    the device's costs."""
    busy = replace(BUSY, checked_rows=(1, 2))
    assert not AutoBudget(busy, Calibration(law=(3.0, 0.0)), 63, 16).should_draft(None)
    rounds = Rounds(busy, true_ms, draft_ms=0.98)
    sizes = rounds.run(12)
    assert sizes[:2] == [1, 4] and min(sizes[3:]) >= 8, sizes
    stored = rounds.saved[-1]
    assert stored.verify_ms[0] == pytest.approx(busy.verify_ms[0], rel=0.05)  # the profile's own scale
    learned = np.array(stored.verify_ms) / stored.verify_ms[0]
    assert stored.disorder() == [] and np.all(np.abs(np.log(learned / [true_ms(r) for r in GRID])) < np.log(1.5))


def test_confirmations_stored_on_another_scale_are_timed_again():
    """A profile an earlier process checked everywhere (draft included), its one row 3x cheaper than this
    process's rounds and its trees 14 to 143 times one row, as one found on a machine was: as stored, auto never
    drafts and no count is unconfirmed to explore. The rounds' scale, 3x off, drops the stored confirmations;
    the decode explores, finds trees cheap and verifies them; what it stores is near the device's costs and
    checked only where this process timed it."""
    shape = (1.0, 1.6, 2.64, 14.2, 46.1, 78.0, 143.2)
    one = true_ms(1) / 3
    found = replace(profile([one * t for t in shape], draft_ms=1.78 * one), checked_rows=GRID, draft_checked=True)
    assert not AutoBudget(found, Calibration(law=(3.0, 0.0)), 63, 16).should_draft(None)
    rounds = Rounds(found, true_ms, draft_ms=0.98)
    sizes = rounds.run(24)
    assert min(sizes[12:]) >= 8, sizes
    stored = rounds.saved[-1]
    learned = np.array(stored.verify_ms) / stored.verify_ms[0]
    assert np.all(np.abs(np.log(learned / [true_ms(r) / true_ms(1) for r in GRID])) < np.log(1.5)), learned
    assert set(stored.checked_rows) < set(GRID)


LIKELY = (1.5, 0.0)  # a drafted node accepted 82% of the time: trees pay at the device's draft cost, not at 6x it


def test_a_draft_confirmed_too_dear_is_timed_again_by_the_next_process():
    """A profile right about every verify count and checked everywhere, its draft confirmed at 6 one-row verifies
    (two drafted rounds slowed alike by another process can confirm so much): as stored, auto never drafts, and
    no count is unconfirmed to explore. A process that has not timed the draft itself drafts in an exploring
    round, finds it cheap and verifies trees from then on; what it stores is the device's draft cost."""
    right = [true_ms(r) for r in GRID]
    found = replace(profile(right, draft_ms=6 * true_ms(1)), checked_rows=GRID, draft_checked=True)
    assert not AutoBudget(found, Calibration(law=LIKELY), 63, 16).should_draft(None)
    rounds = Rounds(found, true_ms, draft_ms=0.98, law=LIKELY)
    sizes = rounds.run(16)
    assert rounds.drafted[EVERY - 1] and min(sizes[EVERY:]) >= 8, sizes
    assert rounds.saved[-1].draft_ms == pytest.approx(0.98, rel=0.05) and rounds.saved[-1].draft_checked


def test_a_draft_rightly_confirmed_dear_is_timed_once_a_process_and_once_in_redraft_declined_rounds():
    """Where the draft truly costs 6 one-row verifies, the price of checking it: one draft early in a process and
    one in every REDRAFT rounds without one, the rest plain steps."""
    from glance_runtime.decode.cost_watch import REDRAFT
    right = [true_ms(r) for r in GRID]
    dear = replace(profile(right, draft_ms=6 * true_ms(1)), checked_rows=GRID, draft_checked=True)
    assert not AutoBudget(dear, Calibration(law=LIKELY), 63, 16).should_draft(None)
    rounds = Rounds(dear, true_ms, draft_ms=6 * true_ms(1), law=LIKELY)
    rounds.run(2 * REDRAFT + 8)
    drafted = [i for i, d in enumerate(rounds.drafted) if d]
    assert drafted[0] == EVERY - 1 and len(drafted) == 3, drafted
    assert all(REDRAFT <= b - a <= REDRAFT + EVERY for a, b in zip(drafted, drafted[1:])), drafted
    assert rounds.saved == [] or rounds.saved[-1].draft_ms == pytest.approx(dear.draft_ms, rel=0.05)


@pytest.mark.parametrize("seed", range(8))
def test_recovery_holds_whatever_the_noise(seed):
    """Other processes slow a random third of the rounds by up to 10x (seeded): the busy profile is still
    learned past: trees of 8 rows or more from the sixth round, and from the twentieth nearly always within 1.6x
    the rows the rule picks with the device's own costs. A cost is its fastest round's, a count timed once
    only lowers it, and an unconfirmed count is timed again."""
    rng = np.random.default_rng(seed)
    slow = (1 + 9 * rng.random(40)) * (rng.random(40) < 1 / 3)
    rounds = Rounds(replace(BUSY, checked_rows=(1, 2)), true_ms, 0.98, noise=lambda i: max(1.0, slow[i]))
    sizes = rounds.run(40)
    device = Rounds(profile([true_ms(r) for r in GRID], draft_ms=0.98), true_ms, 0.98)
    device.run(40)
    assert min(sizes[5:]) >= 8, sizes
    near = [abs(math.log(a / b)) <= math.log(1.6) for a, b in zip(sizes[20:], device.picked[20:])]
    assert np.mean(near) >= 0.9, (sizes, device.picked)


def test_exploring_is_bounded():
    """On a good profile of this device, at most one round in EVERY verifies other than the rule's pick, never
    more than the next measured count above it, and only until every count is confirmed: then never again,
    nor in a later process given what was stored."""
    good = profile([true_ms(r) for r in GRID], draft_ms=0.98)
    rounds = Rounds(good, true_ms, draft_ms=0.98)
    rounds.run(40)
    off = [i for i, (size, pick) in enumerate(zip(rounds.sizes, rounds.picked)) if size != pick]
    assert off and all(i % EVERY == 1 for i in off) and len(off) <= CONFIRM * len(GRID) and max(off) < 20
    timed: set[int] = set()
    for i in off:  # a grid count: smaller than the pick, or at most twice the pick or a count explored before
        size, pick = rounds.sizes[i], rounds.picked[i]
        assert size in GRID and (size < pick or size <= 2 * max(c for c in {pick, *timed} if c < size))
        timed.add(size)
    later = Rounds(rounds.saved[-1], true_ms, draft_ms=0.98)
    later.run(40)
    unconfirmed = len(GRID) - len(rounds.saved[-1].checked_rows)
    assert sum(a != b for a, b in zip(later.sizes, later.picked)) <= CONFIRM * unconfirmed


def test_a_uniformly_slower_machine_changes_no_choice():
    """auto's choices depend on how costs compare, so a machine three times slower than when it was measured
    makes the same choices and stores the same costs (only which counts it confirmed)."""
    good = profile([true_ms(r) for r in GRID], draft_ms=0.98)
    same, slower = Rounds(good, true_ms, 0.98), Rounds(good, lambda r: 3 * true_ms(r), 3 * 0.98)
    assert same.run(30) == slower.run(30)
    assert all(p.verify_ms == pytest.approx(good.verify_ms, rel=1e-3) and p.draft_ms == pytest.approx(0.98, rel=1e-3)
               for p in slower.saved)


def test_a_profile_that_is_right_about_a_dear_device_stops_exploring():
    """Where every drafted row costs three one-row verifies, timing 2 rows confirms that drafting never pays even
    were 4 rows as cheap as 2, so the decode settles on plain steps: after CONFIRM_DEAR timings, since 2 rows at 6x
    one row is dearer than two one-row verifies could plausibly be (what two slowed rounds could also show)."""
    from glance_runtime.decode.cost_watch import CONFIRM_DEAR
    dear = profile([1.0] + [3.0 * r for r in GRID[1:]], draft_ms=0.2)
    rounds = Rounds(dear, lambda r: 1.0 if r == 1 else 3.0 * r, draft_ms=0.2)
    sizes = rounds.run(30)
    explored = 2 * CONFIRM_DEAR
    assert sizes[:explored + 1] == [1, 2] * CONFIRM_DEAR + [1] and set(sizes[explored + 1:]) == {1}, sizes
    assert rounds.saved and rounds.saved[-1].checked_rows[:2] == (1, 2)
    assert rounds.saved[-1].verify_ms == pytest.approx(dear.verify_ms, rel=1e-3)


def test_a_provisional_profile_is_stored_provisional_until_every_count_is_confirmed():
    shaky = replace(profile([true_ms(r) for r in GRID], draft_ms=0.98), provisional=True)
    rounds = Rounds(shaky, true_ms, draft_ms=0.98)
    rounds.run(40)
    assert len(rounds.saved) > 1 and all(p.provisional for p in rounds.saved[:-1])
    last = rounds.saved[-1]  # every count above the smallest tree decoded (8 rows) confirmed: settled
    assert not last.provisional and {8, 16, 32, 64} <= set(last.checked_rows) and not last.problems()


def test_a_confirmation_is_stored_at_once_and_a_waiting_move_when_the_decode_settles():
    """A newly confirmed count is stored with the refit it brings; a smaller move still waiting for its refit is
    applied and stored when the decode ends (`settle`), so what is stored is all that was learned."""
    saved: list[CostProfile] = []
    good = profile([true_ms(r) for r in GRID], draft_ms=0.98)
    watch = CostWatch(good, saved.append, 64, 15)
    for _ in range(4):
        watch.observe(8, true_ms(8), 0.98, 15)
    assert 8 in watch._confirmed and saved and 8 in saved[-1].checked_rows
    stores = len(saved)
    watch.observe(1, true_ms(1), None, None)
    watch.observe(8, 0.7 * true_ms(8), 0.98, 15)  # 30% faster than 8 rows were: waits for its refit
    assert len(saved) == stores and watch.used.verify_cost(8) == pytest.approx(true_ms(8))
    assert watch.settle() and watch.used.verify_cost(8) == pytest.approx(0.7 * true_ms(8))
    assert len(saved) == stores + 1 and saved[-1].verify_cost(8) == pytest.approx(0.7 * true_ms(8), rel=1e-3)


def test_a_small_move_waits_for_the_refit_gap_and_a_large_one_does_not():
    """A fastest time that moved by less than CONTRADICTS is applied once REFIT_GAP rounds have passed since the
    last refit (a refit costs more than it changes); a move of CONTRADICTS or more, and a confirmation, at once."""
    from glance_runtime.decode.cost_watch import CONTRADICTS, REFIT_GAP
    good = profile([true_ms(r) for r in GRID], draft_ms=0.98)
    watch = CostWatch(good, lambda _: None, 64, 15)
    changed = [watch.observe(16, true_ms(16), 0.98, 15) for _ in range(4)]  # the first draft timed, then 16
    assert changed == [False, True, True, False]  # rows confirmed
    before = watch.used.verify_cost(16)
    assert not watch.observe(16, 0.8 * true_ms(16), 0.98, 15)  # 20% faster: waits
    assert watch.used.verify_cost(16) == before
    waited = [watch.observe(16, 0.8 * true_ms(16), 0.98, 15) for _ in range(REFIT_GAP)]
    assert waited.count(True) == 1 and watch.used.verify_cost(16) == pytest.approx(0.8 * before)
    assert watch.observe(16, true_ms(16) / (2 * CONTRADICTS), 0.98, 15)  # much faster: at once
    assert not watch.observe(16, true_ms(16) / (2.4 * CONTRADICTS), 0.98, 15)  # a little faster again: waits...
    assert watch.settle() and watch.used.verify_cost(16) == pytest.approx(true_ms(16) / (2.4 * CONTRADICTS))
    assert not watch.settle()  # ... for the decode's end at most: what is stored is all that was learned


def _explore_reference(policy: AutoBudget, ids: np.ndarray, logp: np.ndarray, surprisal: float | None) -> Tree:
    """An exploring round's tree the long way: the rule's pick from a full growth, then the first target count
    whose expected tokens at the hopeful costs beat the pick's rate by EXPLORE_GAIN, from a second growth."""
    from glance_runtime.decode.auto_budget import EXPLORE_GAIN
    q = policy.calibration.node_scorer(surprisal)
    full = build_tree(5, ids, logp, policy.max_nodes, 8, priority=q)
    expected = 1 + np.concatenate([[0.0], np.cumsum([q(s, d) for s, d in zip(full.scores[1:], full.depths[1:])])])
    used, hope = policy._plan.round_ms, policy._hope.round_ms
    rates = expected / np.array(used[:full.size])
    pick = int(np.argmax(rates)) + 1
    for rows in policy.watch.targets(pick):
        if rows <= full.size and expected[rows - 1] / hope[rows - 1] > rates[pick - 1] * EXPLORE_GAIN:
            return full.prefix(rows)
    return full.prefix(pick)


@pytest.mark.parametrize("seed", range(6))
def test_an_exploring_round_grows_one_tree_and_picks_as_two_growths_would(seed):
    """An exploring round grows past the rule's cut only as far as a count worth timing needs, in the same growth:
    the tree it verifies is the one a full growth and a second, wider one would give."""
    busy = replace(BUSY, checked_rows=(1, 2))
    for stored in (busy, profile([true_ms(r) for r in GRID], draft_ms=0.98)):
        policy = AutoBudget(stored, Calibration(a=1.0, b=0.9, d=-0.2), 63, 16,
                            CostWatch(stored, lambda _: None, 64, 15))
        policy.watch._rounds = 1  # the coming round is one that may explore
        ids, logp = random_draft(seed, offsets=15, spread=1.0 + seed)
        if not policy.should_draft(0.5):
            continue
        tree = policy.grow(5, ids, logp, 8, 0.5)
        want = _explore_reference(policy, ids, logp, 0.5)
        for name in ("tokens", "parents", "depths", "scores"):
            np.testing.assert_array_equal(getattr(tree, name), getattr(want, name))


# --- acceptance learned from the decode's own rounds -----------------------------------------------------------

def _nodes(n: int, seed: int, truth: Calibration) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """n nodes with random path scores and depths, accepted with `truth`'s probabilities (seeded)."""
    rng = np.random.default_rng(seed)
    scores = -rng.exponential(1.5, n)
    depths = rng.integers(1, 10, n)
    surprisals = np.full(n, np.nan)
    accepted = rng.random(n) < truth.node_probability(scores, None, depths)
    return scores, depths, surprisals, accepted


def test_a_refit_finds_the_acceptance_the_nodes_follow_and_keeps_growth_valid():
    truth = Calibration(a=0.8, b=1.6, d=0.0)
    shipped = Calibration(a=0.33, b=0.49, d=-0.3)
    refit = shipped.refitted(*_nodes(20000, 0, truth), prior=4.0)
    assert (refit.a, refit.b, refit.d) == pytest.approx((0.8, 1.6, 0.0), abs=0.12)
    rising = shipped.refitted(*_nodes(20000, 1, Calibration(a=-1.0, b=1.0, d=0.4)), prior=4.0)
    assert rising.d == 0.0 and rising.b >= 0  # q never rises with depth: growth in falling q stays exact
    few = shipped.refitted(*_nodes(3, 2, truth), prior=4.0)
    assert (few.a, few.b, few.d) == pytest.approx((shipped.a, shipped.b, shipped.d), abs=0.3)
    assert (refit.c, refit.law, refit.surprisal_mean) == (shipped.c, shipped.law, shipped.surprisal_mean)


def test_acceptance_is_learned_when_a_decode_settles_never_within_one():
    """The node model is refitted from the verified nodes once LEARN_NODES have been seen, when a decode ends;
    rounds themselves change nothing, and each refit is pulled toward the stored calibration, not the last."""
    from glance_runtime.decode.auto_budget import LEARN_NODES
    shipped = Calibration(a=0.33, b=0.49, d=-0.3)
    policy = AutoBudget(profile([true_ms(r) for r in GRID], draft_ms=0.98), shipped, 63, 16)
    truth = Calibration(a=0.8, b=1.6, d=0.0)
    rng = np.random.default_rng(0)
    seen = 0
    for seed in range(200):
        ids, logp = random_draft(seed, offsets=15, spread=1.0)
        tree = build_tree(5, ids, logp, 15, 8)
        scores, depths = tree.scores[1:], tree.depths[1:]
        drawn = rng.random(len(scores)) < truth.node_probability(scores, None, depths)
        path = (np.flatnonzero(drawn) + 1).tolist()
        policy.observe(RoundLog(entropy=0.1, accepted=1, tree_size=tree.size, draft_ms=0.98, verify_ms=1.0,
                                total_ms=2.0, node_scores=scores.tolist(), node_depths=depths.tolist(), path=path))
        seen += len(scores)
        assert policy.calibration is shipped
        if seen >= LEARN_NODES:
            break
    policy.settle()
    assert abs(policy.calibration.b - truth.b) < abs(shipped.b - truth.b) / 2
    assert policy.stored_calibration is shipped


def test_two_slowed_rounds_cannot_confirm_a_cost_too_dear():
    """On a crowded machine two rounds can be slowed alike: a draft timed twice at 10x the stored one, or 2 rows
    twice at 8x one row (more than two one-row verifies could plausibly cost), is not confirmed until CONFIRM_DEAR
    rounds agree; the draft and the 2 rows stay explored, and a fast round then lowers them."""
    from glance_runtime.decode.cost_watch import CONFIRM_DEAR
    dear = profile([1.0] + [3.0 * r for r in GRID[1:]], draft_ms=1.0)
    watch = CostWatch(dear, lambda _: None, 64, 15)
    watch.observe(1, 1.0, None, None)  # the process's first round
    for _ in range(2):
        watch.observe(1, 1.0, None, None)
        watch.observe(2, 8.0, 10.0, 15)
    assert 2 not in watch._confirmed and not watch.draft_confirmed
    assert 2 in watch.targets(1)
    watch.observe(1, 1.0, None, None)
    watch.observe(2, 1.1, 0.9, 15)
    assert watch.used.verify_cost(2) == pytest.approx(1.1) and watch.used.draft_ms == pytest.approx(0.9)
    for _ in range(CONFIRM_DEAR):
        watch.observe(2, 1.2, 0.9, 15)
    assert 2 in watch._confirmed and watch.draft_confirmed


def _step_policy(draft_ms: float) -> AutoBudget:
    """auto for a step drafter 8 deep (block size 8), over the prior's q (a node's draft path probability), with a
    verify of 1 ms plus 0.01 ms a row and a full-depth draft of `draft_ms` (7 head passes)."""
    grid = row_grid(64)
    cost = CostProfile(device="constructed", rows=grid, verify_ms=tuple(1.0 + 0.01 * r for r in grid),
                       draft_ms=draft_ms, repeats=1, measured_at="2026-01-01T00:00:00")
    return AutoBudget(cost, PRIOR, 63, 8, steps=True)


def test_a_step_drafter_deepens_while_the_next_pass_is_expected_to_pay():
    """A confident path (each node the draft's 0.9) is followed while a pass costs little next to what it adds, and
    not when the pass is dear; a step drafter's chain costs a pass a node, so should_draft weighs passes."""
    chain = [math.log(0.9 ** d) for d in range(1, 8)]

    def passes(policy: AutoBudget) -> int:
        more = policy.deeper(None)
        done = 1
        for depth in range(2, 8):
            scores = [*chain[:depth - 1], math.log(0.05)]
            if not more(scores, [*range(1, depth), 1], [depth - 2]):
                break
            done += 1
        return done

    cheap, dear = _step_policy(0.7), _step_policy(21.0)
    assert passes(cheap) == 7 and passes(dear) == 1
    assert cheap._plan.chain_ms[3] == pytest.approx(3 * 0.1 + 1.0 + 0.04)
    assert dear._plan.chain_ms[1] == pytest.approx(3.0 + 1.02)


# --- how deep to draft --------------------------------------------------------------------------------------

def by_depth(cost: CostProfile, shares: dict[int, float]) -> CostProfile:
    """`cost` with a draft timed at these depths (the last the full one, share 1)."""
    return replace(cost, draft_depths=tuple(shares), draft_share=tuple(shares.values()))


def test_draft_cost_interpolates_by_depth_and_never_falls_going_deeper():
    p = by_depth(profile([1.0] * len(GRID), draft_ms=10.0), {1: 0.5, 2: 0.6, 4: 0.8, 7: 1.0})
    assert [p.draft_cost(d) for d in (1, 2, 3, 4, 7, None)] == pytest.approx([5.0, 6.0, 7.0, 8.0, 10.0, 10.0])
    noisy = by_depth(p, {1: 0.9, 2: 0.6, 4: 0.8, 7: 1.0})  # depth 1 timed dearer than 2: a busy moment
    assert noisy.draft_cost(1) == pytest.approx(6.0) and noisy.draft_cost(2) == pytest.approx(6.0)
    assert [CPU.draft_cost(d) for d in (1, 7, None)] == [1.0, 1.0, 1.0], "no depths timed: one cost"
    assert "ms by depth: 1: 5.00, 2: 6.00, 4: 8.00, 7: 10.00" in p.table()
    assert CostProfile.from_dict(p.as_dict()) == p


def brute_depth(verify_ms, draft_at, p: float, depth: int) -> int:
    """Step 1's depth from the docstring: per depth d, its best chain of m <= d nodes at D(d) + V(m + 1); 0 where
    no depth beats a plain step, else the deepest within DEPTH_SLACK of the best depth's rate."""
    rates = [max(sum(p ** i for i in range(m + 1)) / (draft_at(d) + verify_ms(m + 1)) for m in range(1, d + 1))
             for d in range(1, depth + 1)]
    if max(rates) <= 1 / verify_ms(1):
        return 0
    return max(d for d, rate in enumerate(rates, start=1) if rate >= max(rates) * (1 - DEPTH_SLACK))


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_draft_depth_matches_the_rule_computed_here(block_size):
    """A draft whose cost grows with its depth (a head over short blocks): the depth asked for is the rule's, it
    grows with the anchor's acceptance, and where every depth costs alike a drafting round drafts whole."""
    full = block_size - 1
    grid = row_grid(full)
    law = Calibration(law=(3.0, 1.0))
    depths = set()
    for draft_ms, share in ((2.0, lambda d: d / full), (1.0, lambda d: 0.5 + 0.5 * d / full)):
        cost = by_depth(profile([cpu_ms(r) for r in GRID], draft_ms), {d: share(d) for d in grid})
        for u in np.linspace(0, 6, 25):
            policy = AutoBudget(cost, law, 63, block_size)
            want = brute_depth(cpu_ms, cost.draft_cost, sigmoid(3.0 - u), full)
            drafted = policy.should_draft(float(u))
            assert drafted == (want > 0), u
            if drafted:
                assert (policy.depth_wanted or full) == want, (u, draft_ms)
                depths.add(want)
        flat = AutoBudget(profile([cpu_ms(r) for r in GRID], draft_ms), law, 63, block_size)
        assert all(flat.depth_wanted is None for u in np.linspace(0, 6, 25) if flat.should_draft(float(u)))
    assert len(depths) >= 3, f"the sweep must ask for several depths, not {depths}"


def test_a_shallow_round_is_cut_at_its_own_drafts_cost():
    """Step 2 after a draft d deep counts D(d), not the full draft's: the same tree as the rule computed with it."""
    cost = by_depth(profile([cpu_ms(r) for r in GRID], draft_ms=3.0), {1: 0.1, 2: 0.2, 4: 0.4, 9: 1.0})
    for seed in range(4):
        for depth in (2, 4, 9):
            ids, logp = random_draft(seed, offsets=depth, spread=1.5 + seed)
            tree = AutoBudget(cost, PRIOR, 63, 10).grow(5, ids, logp, 8, 0.5)
            want = brute_grow(cpu_ms, cost.draft_cost(depth), ids, logp, PRIOR, 0.5, 63)
            np.testing.assert_array_equal(tree.tokens, want.tokens)
            np.testing.assert_array_equal(tree.parents, want.parents)


def test_a_shallow_drafts_own_time_replaces_its_stored_share():
    """The decode's own shallow drafts set their depth's cost (twice alike, as a verify count is confirmed); the
    full draft's, and the draft costs stored, are untouched by them."""
    stored = by_depth(profile([true_ms(r) for r in GRID], draft_ms=4.0), {1: 0.25, 2: 0.5, 4: 0.75, 15: 1.0})
    watch = CostWatch(stored, lambda _: None, 64, 15)
    for _ in range(1 + CONFIRM):
        watch.observe(4, true_ms(4), 3.0, 2)  # depth 2 costs 3 ms here, stored at 2 ms
    assert watch.used.draft_cost(2) == pytest.approx(3.0)
    assert watch.used.draft_cost(1) == pytest.approx(1.0) and watch.used.draft_cost(None) == pytest.approx(4.0)
    written = watch.written
    assert (written.draft_ms, written.draft_depths, written.draft_share) == (4.0, stored.draft_depths,
                                                                              stored.draft_share)
    flat = CostWatch(profile([true_ms(r) for r in GRID], draft_ms=4.0), lambda _: None, 64, 15)
    for _ in range(1 + CONFIRM):
        flat.observe(4, true_ms(4), 1.0, 2)
    assert flat.used.draft_cost(2) == pytest.approx(4.0), "a profile without depths keeps one draft cost"


def test_an_exploring_round_drafts_whole_while_the_drafts_cost_is_unsure():
    """While the full draft's cost is to be timed, a round that explores drafts the whole block (its hopeful
    costs count the draft as free), so the draft cost every depth scales from gets timed."""
    stored = by_depth(profile([cpu_ms(r) for r in GRID], draft_ms=4.0), {1: 0.1, 2: 0.2, 4: 0.4, 15: 1.0})
    policy = AutoBudget(stored, Calibration(law=(1.0, 0.0)), 63, 16, CostWatch(stored, lambda _: None, 64, 15))
    asked = []
    for _ in range(6):
        unsure = policy.watch.draft_unsure
        drafted = policy.should_draft(None)
        asked.append((drafted, policy.depth_wanted, policy._exploring and unsure))
        tree = policy.grow(5, *random_draft(1, offsets=policy.depth_wanted or 15), 8, None) if drafted else Tree.root(5)
        policy.observe(RoundLog(entropy=0.1, accepted=1, tree_size=tree.size, draft_ms=1.0 if drafted else 0.0,
                                verify_ms=cpu_ms(tree.size), total_ms=cpu_ms(tree.size) + drafted, drafted=drafted))
    assert any(d and w is not None for d, w, e in asked if not e), f"no shallow draft outside exploring: {asked}"
    assert any(e for _, _, e in asked) and all(w is None for d, w, e in asked if e and d), asked
    assert not policy.watch.draft_unsure, "the full draft's cost was timed and confirmed"
