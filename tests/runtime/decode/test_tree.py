"""Property and hand-checked tests for glance_runtime.decode.tree (draft tree build, visibility, walk)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glance_runtime.decode.tree import Tree, build_tree, visibility, walk, walked_choices

pytestmark = pytest.mark.edge  # needs no torch: runs on the edge install too

FAST = settings(max_examples=100, deadline=None)
ANCHOR = 1000


@st.composite
def drafts(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(topk_ids, topk_logprobs, budget, branch_k) small enough to enumerate every node.

    Log-probs come from a coarse grid so that equal scores (ties) are common.
    """
    offsets = draw(st.integers(1, 4))
    k = draw(st.integers(1, 4))
    branch_k = draw(st.integers(1, k))
    grid = st.sampled_from([0.0, -0.25, -0.5, -1.0, -1.5, -2.0, -3.0, -np.inf])
    free = st.floats(min_value=-8.0, max_value=0.0, allow_nan=False)
    value = st.one_of(grid, free)
    logprobs = np.array([sorted((draw(value) for _ in range(k)), reverse=True) for _ in range(offsets)])
    vocab = k + 3
    ids = np.array([draw(st.permutations(range(vocab)))[:k] for _ in range(offsets)], dtype=np.int64)
    total = sum(branch_k**d for d in range(1, offsets + 1))
    budget = draw(st.integers(0, total + 3))
    return ids, logprobs, budget, branch_k


def all_nodes(logprobs: np.ndarray, branch_k: int) -> list[tuple[float, int]]:
    """Brute force: (score, depth) of every possible node (every column choice sequence)."""
    nodes = []
    for depth in range(1, logprobs.shape[0] + 1):
        for cols in itertools.product(range(branch_k), repeat=depth):
            score = 0.0
            for offset, col in enumerate(cols):
                score += float(logprobs[offset, col])
            nodes.append((score, depth))
    return nodes


def all_node_scores(logprobs: np.ndarray, branch_k: int) -> list[float]:
    return [score for score, _ in all_nodes(logprobs, branch_k)]


def ancestors(parents: np.ndarray, i: int) -> set[int]:
    """i and every node reached by following parents to the root."""
    seen = set()
    while i >= 0:
        seen.add(i)
        i = int(parents[i])
    return seen


@st.composite
def parent_arrays(draw: st.DrawFn, max_size: int = 40) -> np.ndarray:
    """Any valid parents-first parent array."""
    size = draw(st.integers(1, max_size))
    return np.array([-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)], dtype=np.int64)


def make_tree(tokens: list[int], parents: list[int]) -> Tree:
    """Hand-built tree with depths derived from parents and dummy scores."""
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    scores = [0.0] + [-float(d) for d in depths[1:]]
    return Tree(np.array(tokens), np.array(parents), np.array(depths), np.array(scores))


# (1) optimality


@FAST
@given(drafts())
def test_kept_scores_are_the_top_budget_scores(case: tuple) -> None:
    ids, logprobs, budget, branch_k = case
    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    every = sorted(all_node_scores(logprobs, branch_k), reverse=True)
    expected = every[:budget]
    assert tree.size == len(expected) + 1
    kept = sorted(tree.scores[1:].tolist(), reverse=True)
    np.testing.assert_allclose(kept, expected, rtol=0, atol=1e-9)


@FAST
@given(drafts(), st.data())
def test_prefix_of_a_best_first_tree_is_the_smaller_budgets_tree(case: tuple, data: st.DataObject) -> None:
    """Cutting the largest tree gives exactly the tree a smaller budget builds: what auto relies on."""
    ids, logprobs, budget, branch_k = case
    full = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    size = data.draw(st.integers(1, full.size))
    cut, direct = full.prefix(size), build_tree(ANCHOR, ids, logprobs, size - 1, branch_k)
    for name in ("tokens", "parents", "depths", "scores"):
        np.testing.assert_array_equal(getattr(cut, name), getattr(direct, name))
    assert full.prefix(full.size) is full
    with pytest.raises(ValueError, match="size must be"):
        full.prefix(0)


@FAST
@given(drafts(), st.floats(0.0, 2.0))
def test_priority_picks_the_best_prefix_closed_set_by_that_priority(case: tuple, slope: float) -> None:
    """A priority falling with depth (as auto's calibrated acceptance does) keeps exactly the `budget` nodes
    it ranks highest, parents first."""
    ids, logprobs, budget, branch_k = case
    priority = lambda score, depth: score - slope * depth  # noqa: E731
    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k, priority=priority)
    keys = [priority(s, d) for s, d in zip(tree.scores[1:], tree.depths[1:])]
    assert keys == sorted(keys, reverse=True)  # popped in priority order
    assert np.all(tree.parents[1:] < np.arange(1, tree.size))
    every = sorted((s - slope * d for s, d in all_nodes(logprobs, branch_k)), reverse=True)
    np.testing.assert_allclose(sorted(keys, reverse=True), every[: tree.size - 1], rtol=0, atol=1e-9)


@FAST
@given(drafts(), st.integers(0, 12))
def test_stop_ends_growth_and_sees_each_next_priority(case: tuple, after: int) -> None:
    ids, logprobs, budget, branch_k = case
    seen: list[tuple[int, float]] = []

    def stop(nodes: int, next_key: float) -> bool:
        seen.append((nodes, next_key))
        return nodes >= after

    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k, stop=stop)
    full = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    assert tree.size == min(after, full.size - 1) + 1
    np.testing.assert_array_equal(tree.tokens, full.prefix(tree.size).tokens)
    assert [n for n, _ in seen] == list(range(len(seen)))
    np.testing.assert_allclose([k for _, k in seen[: tree.size - 1]], full.scores[1:tree.size])


@FAST
@given(drafts(), st.integers(0, 6))
def test_a_leaf_token_gets_no_children_and_the_budget_goes_to_the_best_other_nodes(case: tuple, leaf: int) -> None:
    """A stop token ends the answer: nodes below it are never built, and the budget buys the best of the rest."""
    ids, logprobs, budget, branch_k = case
    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k, leaves=frozenset({leaf}))
    assert all(tree.tokens[p] != leaf for p in tree.parents[1:])
    reachable = []
    for depth in range(1, ids.shape[0] + 1):
        for cols in itertools.product(range(branch_k), repeat=depth):
            if all(ids[offset, col] != leaf for offset, col in enumerate(cols[:-1])):
                reachable.append(sum(float(logprobs[offset, col]) for offset, col in enumerate(cols)))
    expected = sorted(reachable, reverse=True)[:budget]
    assert tree.size == len(expected) + 1
    np.testing.assert_allclose(sorted(tree.scores[1:].tolist(), reverse=True), expected, rtol=0, atol=1e-9)


@FAST
@given(drafts())
def test_node_scores_and_tokens_match_their_columns(case: tuple) -> None:
    ids, logprobs, budget, branch_k = case
    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    for i in range(1, tree.size):
        row = tree.depths[i] - 1
        (col,) = np.flatnonzero(ids[row, :branch_k] == tree.tokens[i])
        np.testing.assert_allclose(tree.scores[i], tree.scores[tree.parents[i]] + logprobs[row, col], atol=1e-12)


# (2) structure


@FAST
@given(drafts())
def test_prefix_closed_parents_first_and_depths(case: tuple) -> None:
    ids, logprobs, budget, branch_k = case
    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    assert tree.tokens[0] == ANCHOR and tree.parents[0] == -1 and tree.depths[0] == 0 and tree.scores[0] == 0
    for arr, dtype in ((tree.tokens, np.int64), (tree.parents, np.int64), (tree.depths, np.int64), (tree.scores, np.float64)):
        assert arr.dtype == dtype and arr.shape == (tree.size,)
    idx = np.arange(1, tree.size)
    assert np.all(tree.parents[1:] >= 0) and np.all(tree.parents[1:] < idx)
    assert np.all(tree.depths[1:] == tree.depths[tree.parents[1:]] + 1)
    assert np.all(tree.depths <= ids.shape[0])
    # Pop order: scores never increase along the packing.
    kept = tree.scores[1:]
    assert np.all(kept[1:] <= kept[:-1])  # not np.diff: -inf - -inf is NaN
    # Siblings carry distinct tokens.
    edges = list(zip(tree.parents[1:].tolist(), tree.tokens[1:].tolist()))
    assert len(set(edges)) == len(edges)


def test_budget_zero_is_root_only_and_large_budget_keeps_all() -> None:
    ids = np.array([[3, 4], [5, 6], [7, 8]])
    lp = np.log(np.array([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]]))
    root = build_tree(9, ids, lp, 0)
    assert root.size == 1 and root.tokens.tolist() == [9] and root.parents.tolist() == [-1]
    full = build_tree(9, ids, lp, 10_000)
    assert full.size == 1 + 2 + 4 + 8
    assert build_tree(9, ids, lp, 10_000, branch_k=1).size == 4


def test_tree_arrays_are_read_only() -> None:
    tree = build_tree(9, np.array([[3, 4]]), np.array([[-0.1, -1.0]]), 2)
    with pytest.raises(ValueError):
        tree.tokens[0] = 1


@pytest.mark.parametrize(
    "args, message",
    [
        ((1, np.array([3, 4]), np.array([-0.1, -1.0]), 1), "2-D"),
        ((1, np.array([[3, 4]]), np.array([[-0.1]]), 1), "shape"),
        ((1, np.array([[3, 4]]), np.array([[-0.1, -1.0]]), -1), "budget"),
        ((1, np.array([[3, 4]]), np.array([[-0.1, -1.0]]), 1, 0), "branch_k"),
        ((1, np.array([[3, 4]]), np.array([[-0.1, -1.0]]), 1, 3), "branch_k"),
        ((1, np.array([[3, 4]]), np.array([[-1.0, -0.1]]), 1), "sorted"),
        ((1, np.array([[3, 3]]), np.array([[-0.1, -1.0]]), 1), "distinct"),
        ((1, np.array([[3, 4]]), np.array([[0.5, -1.0]]), 1), "<= 0"),
        ((1, np.array([[3, 4]]), np.array([[np.nan, -1.0]]), 1), "NaN"),
        ((-1, np.array([[3, 4]]), np.array([[-0.1, -1.0]]), 1), "anchor"),
        ((1, np.array([[3.0, 4.0]]), np.array([[-0.1, -1.0]]), 1), "integers"),
        ((1, np.zeros((1, 0), dtype=np.int64), np.zeros((1, 0)), 1), "K >= 1"),
    ],
)
def test_build_tree_rejects_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tree(*args)


def test_tree_rejects_inconsistent_arrays() -> None:
    depths, scores = np.array([0, 1, 2]), np.array([0.0, -1.0, -2.0])
    with pytest.raises(ValueError, match="parents"):
        Tree(np.array([1, 2, 3]), np.array([-1, 2, 0]), depths, scores)
    with pytest.raises(ValueError, match="parents"):
        Tree(np.array([1, 2, 3]), np.array([0, 0, 1]), depths, scores)
    with pytest.raises(ValueError, match="depths"):
        Tree(np.array([1, 2]), np.array([-1, 0]), np.array([0, 2]), np.array([0.0, -1.0]))
    with pytest.raises(ValueError, match="distinct"):
        make_tree([1, 2, 2], [-1, 0, 0])


# (3) determinism and ties


@FAST
@given(drafts())
def test_same_input_gives_identical_arrays(case: tuple) -> None:
    ids, logprobs, budget, branch_k = case
    a = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    b = build_tree(ANCHOR, ids.copy(), logprobs.copy(), budget, branch_k)
    for name in ("tokens", "parents", "depths", "scores"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_ties_break_by_insertion_order() -> None:
    ids = np.array([[10, 11], [20, 21]])
    # Both depth-1 nodes score -1; column 0 was inserted first, so it wins a budget of 1.
    lp = np.array([[-1.0, -1.0], [-0.5, -2.0]])
    assert build_tree(0, ids, lp, 1).tokens.tolist() == [0, 10]
    # Budget 3: the two -1.5 grandchildren tie; 10's child was inserted before 11's.
    t = build_tree(0, ids, lp, 3)
    assert t.tokens.tolist() == [0, 10, 11, 20]
    assert t.parents.tolist() == [-1, 0, 0, 1]
    # A deeper node tying a shallower one: 10->20 scores -1 + 0 = -1, same as 11, but 11 was
    # pushed (with the root's children) before 10's children existed, so 11 wins.
    lp = np.array([[-1.0, -1.0], [0.0, -5.0]])
    t = build_tree(0, ids, lp, 2)
    assert t.tokens.tolist() == [0, 10, 11] and t.parents.tolist() == [-1, 0, 0]
    t = build_tree(0, ids, lp, 3)
    assert t.tokens.tolist() == [0, 10, 11, 20] and t.parents.tolist() == [-1, 0, 0, 1]


# (4) visibility and additive mask


@FAST
@given(parent_arrays())
def test_visibility_rows_are_ancestor_sets(parents: np.ndarray) -> None:
    vis = visibility(parents)
    assert vis.dtype == np.bool_ and vis.shape == (len(parents), len(parents))
    for i in range(len(parents)):
        assert set(np.flatnonzero(vis[i]).tolist()) == ancestors(parents, i)


def test_visibility_hand_example_and_validation() -> None:
    vis = visibility(np.array([-1, 0, 0, 1]))
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    np.testing.assert_array_equal(vis, expected)
    with pytest.raises(ValueError):
        visibility(np.array([0, 0]))
    with pytest.raises(ValueError):
        visibility(np.array([-1, 1]))


# (5) chain (branch 1: the ablation)


@FAST
@given(drafts(), st.data())
def test_branch_one_is_the_top1_path(case: tuple, data: st.DataObject) -> None:
    ids, logprobs, _, _ = case
    length = data.draw(st.integers(1, ids.shape[0]))
    chain = build_tree(ANCHOR, ids, logprobs, length, branch_k=1)
    assert chain.size == length + 1
    assert chain.parents.tolist() == list(range(-1, length))
    assert chain.depths.tolist() == list(range(length + 1))
    assert chain.tokens[1:].tolist() == ids[:length, 0].tolist()


# (6) walk

# root(100) -> 1:5 -> 3:9
#           -> 2:7 -> 4:11 -> 6:13
#                  -> 5:12
BRANCHY = make_tree([100, 5, 7, 9, 11, 12, 13], [-1, 0, 0, 1, 2, 2, 4])


def test_walk_full_acceptance_down_a_non_first_branch() -> None:
    argmax = np.array([7, 77, 11, 77, 13, 77, 42])
    path, bonus = walk(BRANCHY, argmax)
    assert path.dtype == np.int64 and path.tolist() == [2, 4, 6] and bonus == 42


def test_walk_partial_acceptance() -> None:
    path, bonus = walk(BRANCHY, np.array([5, 99, 0, 0, 0, 0, 0]))
    assert path.tolist() == [1] and bonus == 99
    path, bonus = walk(BRANCHY, np.array([7, 0, 12, 0, 0, 0, 0]))
    assert path.tolist() == [2, 5] and bonus == 0


def test_walk_zero_acceptance() -> None:
    path, bonus = walk(BRANCHY, np.array([8, 5, 7, 9, 11, 12, 13]))
    assert path.dtype == np.int64 and path.shape == (0,) and bonus == 8


def test_walk_full_chain_and_validation() -> None:
    chain = make_tree([1, 2, 3, 4], [-1, 0, 1, 2])
    path, bonus = walk(chain, np.array([2, 3, 4, 5]))
    assert path.tolist() == [1, 2, 3] and bonus == 5
    with pytest.raises(ValueError, match="shape"):
        walk(chain, np.array([2, 3, 4]))


@FAST
@given(drafts(), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_walk_path_is_a_greedy_chain(case: tuple, seed: int, follow: float) -> None:
    ids, logprobs, budget, branch_k = case
    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    rng = np.random.default_rng(seed)
    children: dict[int, list[int]] = {}
    for i in range(1, tree.size):
        children.setdefault(int(tree.parents[i]), []).append(i)
    # With probability `follow`, row i's argmax is one of its children's tokens, so walks go deep.
    argmax = rng.integers(0, ids.max() + 2, size=tree.size)
    for i, kids in children.items():
        if rng.random() < follow:
            argmax[i] = tree.tokens[rng.choice(kids)]
    path, bonus = walk(tree, argmax)
    prev = 0
    for node in path.tolist():
        assert tree.parents[node] == prev
        assert tree.tokens[node] == argmax[prev]
        prev = node
    assert bonus == argmax[prev]
    assert all(tree.tokens[c] != bonus for c in children.get(prev, []))


@FAST
@given(drafts(), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_walked_choices_asks_for_the_rows_the_walk_reads_only(case: tuple, seed: int, follow: float) -> None:
    """From what a backend receives (tokens, depths, visibility), the rows asked for are exactly the walk's path
    and the row after it, and the walk over those tokens alone (anything elsewhere) takes the same path."""
    ids, logprobs, budget, branch_k = case
    tree = build_tree(ANCHOR, ids, logprobs, budget, branch_k)
    rng = np.random.default_rng(seed)
    argmax = rng.integers(0, ids.max() + 2, size=tree.size)
    for i in range(1, tree.size):
        if rng.random() < follow:
            argmax[tree.parents[i]] = tree.tokens[i]
    asked: list[int] = []
    chosen = walked_choices(tree.tokens, tree.depths, visibility(tree.parents),
                            lambda row: asked.append(row) or int(argmax[row]))
    path, bonus = walk(tree, argmax)
    assert asked == [0, *path.tolist()] and chosen == {r: int(argmax[r]) for r in asked}
    sparse = np.full(tree.size, -1)
    sparse[list(chosen)] = list(chosen.values())
    sparse_path, sparse_bonus = walk(tree, sparse)
    assert sparse_path.tolist() == path.tolist() and sparse_bonus == bonus
