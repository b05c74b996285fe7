"""The EAGLE-2 growth of step drafters' trees: equal to expanding blindly and keeping the best, in fewer passes."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from glance_runtime.decode.dynamic_tree import grow_dynamic
from glance_runtime.decode.tree import Tree, visibility

VOCAB = 40


class PathDrafter:
    """Children of a path drawn from the path itself (the same path always drafts the same children), log-probs
    rounded to one decimal so ties between nodes happen often. Counts passes and rows."""

    def __init__(self, seed: int):
        self.seed, self.passes, self.rows = seed, 0, 0

    def children(self, path: tuple[int, ...], k: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, len(path), *path])
        ids = rng.choice(VOCAB, size=k, replace=False)
        logp = -np.sort(np.round(rng.exponential(1.0, size=k), 1))  # best first, <= 0
        return ids.astype(np.int64), logp

    def draft_root(self, anchor: int, k: int):
        self.paths, self.passes, self.rows = [], 1, 1
        return self.children((), k)

    def draft_step(self, tokens, parents, k: int):
        self.passes += 1
        self.rows += len(tokens)
        out_ids, out_logp = [], []
        for token, parent in zip(tokens.tolist(), parents.tolist()):
            path = (self.paths[parent] if parent >= 0 else ()) + (token,)
            self.paths.append(path)
            ids, logp = self.children(path, k)
            out_ids.append(ids)
            out_logp.append(logp)
        return np.array(out_ids), np.array(out_logp)


def blind(seed: int, budget: int, k: int, depth: int, leaves: frozenset[int]) -> list[tuple[tuple[int, ...], float]]:
    """EAGLE-2 without shortcuts: expand the k best of every depth, then keep the `budget` best of all (ties to the
    node drafted first). Returns (path, score) in that order."""
    drafter = PathDrafter(seed)
    nodes: list[tuple[tuple[int, ...], float]] = []
    ids, logp = drafter.children((), k)
    frontier = []
    for t, lp in zip(ids.tolist(), logp.tolist()):
        nodes.append(((t,), lp))
        frontier.append(len(nodes) - 1)
    for _ in range(2, depth + 1):
        ranked = sorted((n for n in frontier if nodes[n][0][-1] not in leaves), key=lambda n: (-nodes[n][1], n))[:k]
        frontier = []
        for n in ranked:
            ids, logp = drafter.children(nodes[n][0], k)
            for t, lp in zip(ids.tolist(), logp.tolist()):
                nodes.append((nodes[n][0] + (t,), nodes[n][1] + lp))
                frontier.append(len(nodes) - 1)
    order = sorted(range(len(nodes)), key=lambda n: (-nodes[n][1], n))[:budget]
    return [nodes[n] for n in order]


def paths(tree: Tree) -> list[tuple[tuple[int, ...], float]]:
    out = []
    for i in range(1, tree.size):
        path, node = [], i
        while node > 0:
            path.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        out.append((tuple(reversed(path)), float(tree.scores[i])))
    return out


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 70), k=st.integers(1, 6), depth=st.integers(1, 7),
       leaves=st.sets(st.integers(0, VOCAB - 1), max_size=4))
def test_growth_equals_blind_expansion(seed, budget, k, depth, leaves):
    drafter = PathDrafter(seed)
    tree = grow_dynamic(7, drafter, budget, k, depth, leaves=frozenset(leaves))
    expected = blind(seed, budget, k, depth, frozenset(leaves))
    assert paths(tree) == expected
    assert drafter.passes <= depth
    Tree(tree.tokens, tree.parents, tree.depths, tree.scores)  # validates: parents first, siblings distinct
    assert visibility(tree.parents).shape == (tree.size, tree.size)
    for i in range(1, tree.size):  # every prefix is the best tree of its size
        assert tree.scores[i] <= tree.scores[tree.parents[i]] or tree.parents[i] == 0


def test_a_chain_drafts_one_row_a_depth_and_stops_below_a_stop_token():
    drafter = PathDrafter(3)
    tree = grow_dynamic(1, drafter, 5, 1, 5)
    assert tree.depths.tolist() == [0, 1, 2, 3, 4, 5] and drafter.passes == 5 and drafter.rows == 5
    first = int(tree.tokens[1])
    stopped = grow_dynamic(1, PathDrafter(3), 5, 1, 5, leaves=frozenset({first}))
    assert stopped.size == 2


def test_nodes_that_cannot_be_kept_are_not_expanded():
    """With a budget of k, depth 1 already holds k nodes and only those beating the k-th best are worth a pass."""
    drafter = PathDrafter(11)
    grow_dynamic(0, drafter, 4, 4, 6)
    full = PathDrafter(11)
    grow_dynamic(0, full, 64, 4, 6)
    assert drafter.rows < full.rows


def test_growth_ends_where_deeper_says_and_keeps_the_best_of_what_was_drafted():
    asked = []

    def deeper(scores, depths, chosen):
        asked.append((len(scores), max(depths)))
        return len(asked) < 2

    drafter = PathDrafter(5)
    tree = grow_dynamic(0, drafter, 63, 4, 7, deeper=deeper)
    assert drafter.passes == 2 and asked == [(4, 1), (20, 2)]  # the second pass expanded 4 nodes into 4 each
    assert tree.size == 1 + 20 and paths(tree) == blind(5, 63, 4, 2, frozenset())
