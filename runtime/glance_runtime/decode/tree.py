"""Draft trees for one decoding round: build, mask, and walk (pure numpy, no torch).

The draft head gives top-k candidates per offset in one pass; offsets are conditionally
independent, so a path's score is the sum of its offsets' log-probs and the best tree of a
given size can be grown best-first without further draft passes. The verify pass needs the
tree packed parents-first with an ancestor-only attention mask (`visibility`: the boolean
`tree_mask [T, T]` every exported target graph takes, on ONNX Runtime and TensorRT alike; the graph
turns it into its additive mask), and the walk turns the target's argmaxes back into the accepted
path plus the bonus token.
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

__all__ = ["Tree", "build_tree", "fit", "visibility", "walk"]


def _is_int(value: object) -> bool:
    """True for Python/numpy integers but not bools (a bool budget is almost surely a bug)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_parents(parents: np.ndarray) -> np.ndarray:
    """Parents as int64 [T], T >= 1, root first and every parent packed before its child."""
    arr = np.asarray(parents)
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"parents must be a non-empty 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"parents must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr[0] != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {arr[0]}")
    rest = arr[1:]
    if np.any(rest < 0) or np.any(rest >= np.arange(1, arr.shape[0])):
        raise ValueError("parents must satisfy 0 <= parents[i] < i for i >= 1 (packed parents-first)")
    return arr


class Tree:
    """A packed draft tree: `tokens`, `parents`, `depths` and `scores` [T] each, root first, validated and
    converted on construction and read-only after it (the loop, the round log and the budget policies
    share one tree, so none of them may change it). Compare trees by their arrays."""

    __slots__ = ("tokens", "parents", "depths", "scores")

    def __init__(self, tokens, parents, depths, scores) -> None:
        parents = _check_parents(parents)
        size = parents.shape[0]
        tokens = np.asarray(tokens)
        depths = np.asarray(depths)
        scores = np.asarray(scores)
        for name, arr, kinds in (("tokens", tokens, "iu"), ("depths", depths, "iu"), ("scores", scores, "iuf")):
            if arr.shape != (size,):
                raise ValueError(f"{name} must have shape ({size},) like parents, got {arr.shape}")
            if arr.dtype.kind not in kinds:
                raise ValueError(f"{name} has unsupported dtype {arr.dtype}")
        tokens = tokens.astype(np.int64)
        depths = depths.astype(np.int64)
        scores = scores.astype(np.float64)
        if depths[0] != 0 or np.any(depths[1:] != depths[parents[1:]] + 1):
            raise ValueError("depths must be 0 at the root and parent depth + 1 elsewhere")
        if scores[0] != 0.0:
            raise ValueError(f"scores[0] must be 0 (the root), got {scores[0]}")
        if size > 1:
            # The walk follows (parent, token) edges, so siblings must carry distinct tokens.
            edges = np.stack([parents[1:], tokens[1:]], axis=1)
            if np.unique(edges, axis=0).shape[0] != size - 1:
                raise ValueError("sibling nodes must carry distinct tokens")
        self._freeze(tokens, parents.copy(), depths, scores)

    def _freeze(self, *arrays: np.ndarray) -> None:
        for name, arr in zip(self.__slots__, arrays):
            arr.setflags(write=False)  # on a view of read-only arrays (a prefix) this is already so
            setattr(self, name, arr)

    @classmethod
    def _trusted(cls, tokens: list[int], parents: list[int], depths: list[int], scores: list[float]) -> "Tree":
        """Skip validation for trees this module built itself (the per-round hot path)."""
        tree = cls.__new__(cls)
        tree._freeze(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64),
                     np.array(depths, dtype=np.int64), np.array(scores, dtype=np.float64))
        return tree

    @classmethod
    def root(cls, anchor: int) -> "Tree":
        """The anchor alone: a verify pass of one row is a plain autoregressive step."""
        return cls._trusted([int(anchor)], [-1], [0], [0.0])

    def prefix(self, size: int) -> "Tree":
        """The first `size` packed nodes: a tree again, since every parent is packed before its child.
        On a best-first tree it is the best tree of that size, which is how a round cuts its budget."""
        if not _is_int(size) or not 1 <= size <= self.size:
            raise ValueError(f"size must be an integer in 1..{self.size}, got {size!r}")
        if size == self.size:
            return self
        tree = Tree.__new__(Tree)
        tree._freeze(*(getattr(self, name)[:size] for name in self.__slots__))
        return tree

    @property
    def size(self) -> int:
        """Packed length T, root included."""
        return int(self.parents.shape[0])


def build_tree(
    anchor: int,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    budget: int,
    branch_k: int | None = None,
    priority: Callable[[float, int], float] | None = None,
    stop: Callable[[int, float], bool] | None = None,
    leaves: frozenset[int] = frozenset(),
) -> Tree:
    """Keep the `budget` best draft nodes, best-first on cumulative log-prob (or on `priority`).

    Row d-1 of topk_ids/topk_logprobs holds offset d's candidates, best first. Because
    log-probs are <= 0 a child never outscores its parent, so popping a max-heap yields the
    exact top-`budget` node set, prefix-closed and already in parents-first order. The heap
    key (-score, insertion counter) makes ties resolve by insertion order.

    `priority(score, depth)` ranks nodes instead of their score; it must not rise from a node to its
    children or its later siblings (as a score does not), or the pops stop being the best set.
    `stop(nodes, next_priority)`, asked before each pop, ends the growth early when it returns True.
    A node whose token is in `leaves` gets no children: a stop token ends the answer, so nothing verified
    below it could be kept, and the budget goes to the nodes that can.
    """
    if not _is_int(anchor) or anchor < 0:
        raise ValueError(f"anchor must be a non-negative integer token id, got {anchor!r}")
    ids = np.asarray(topk_ids)
    logprobs = np.asarray(topk_logprobs)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be 2-D [B-1, K], got shape {ids.shape}")
    if logprobs.shape != ids.shape:
        raise ValueError(f"topk_logprobs shape {logprobs.shape} must equal topk_ids shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must be integers, got dtype {ids.dtype}")
    if logprobs.dtype.kind not in "iuf":
        raise ValueError(f"topk_logprobs must be real numbers, got dtype {logprobs.dtype}")
    offsets, k = ids.shape
    if k < 1:
        raise ValueError("topk_ids needs at least one column (K >= 1)")
    if not _is_int(budget) or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget!r}")
    if branch_k is None:
        branch_k = k
    if not _is_int(branch_k) or not 1 <= branch_k <= k:
        raise ValueError(f"branch_k must be an integer in 1..{k}, got {branch_k!r}")
    ids = ids.astype(np.int64)
    logprobs = logprobs.astype(np.float64)
    if np.any(ids < 0):
        raise ValueError("topk_ids must be non-negative token ids")
    if np.any(np.isnan(logprobs)) or np.any(logprobs > 0):
        raise ValueError("topk_logprobs must be log-probabilities (<= 0, no NaN)")
    if np.any(logprobs[:, 1:] > logprobs[:, :-1]):
        raise ValueError("topk_logprobs rows must be sorted by descending log-prob")
    used = np.sort(ids[:, :branch_k], axis=1)
    if np.any(used[:, 1:] == used[:, :-1]):
        raise ValueError("topk_ids must be distinct within each row")

    tokens = [int(anchor)]
    parents = [-1]
    depths = [0]
    scores = [0.0]
    rank = priority or (lambda score, _depth: score)
    # Lazy best-first: a popped node pushes only its best child and its next sibling, since every
    # other candidate ranks no higher than one of those two. Keying ties on (parent's packed index,
    # column) pops nodes in exactly the order of pushing all children at once: insertion order.
    heap: list[tuple[float, int, int, int, float]] = []  # (-rank, parent index, column, depth, score)
    lp, id_rows = logprobs.tolist(), ids.tolist()  # Python scalars: the loop below is hot
    if offsets:
        heap.append((-rank(lp[0][0], 1), 0, 0, 1, lp[0][0]))
    while heap and len(tokens) <= budget:
        if stop is not None and stop(len(tokens) - 1, -heap[0][0]):
            break
        _, parent, col, depth, score = heapq.heappop(heap)
        index = len(tokens)
        tokens.append(id_rows[depth - 1][col])
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        if col + 1 < branch_k:
            sibling = scores[parent] + lp[depth - 1][col + 1]
            heapq.heappush(heap, (-rank(sibling, depth), parent, col + 1, depth, sibling))
        if depth < offsets and tokens[index] not in leaves:
            child = score + lp[depth][0]
            heapq.heappush(heap, (-rank(child, depth + 1), index, 0, depth + 1, child))
    return Tree._trusted(tokens, parents, depths, scores)


def fit(tree: Tree, room: int) -> Tree:
    """`tree` cut to the `room` rows a verify pass can still add (never below the anchor alone).

    A best-first tree's prefix is the best tree of that size, so near the end of the context a round
    still verifies the most promising nodes, down to a plain greedy step: the output stays greedy's."""
    if not _is_int(room):
        raise ValueError(f"room must be an integer, got {room!r}")
    return tree.prefix(max(1, min(tree.size, int(room))))


def visibility(parents: np.ndarray) -> np.ndarray:
    """bool [T, T]: row i marks i and its ancestors, i.e. what packed token i may attend to.

    Climbs all rows one ancestor level at a time, so the loop runs depth + 1 times, not T.
    """
    parents = _check_parents(parents)
    size = parents.shape[0]
    visible = np.zeros((size, size), dtype=bool)
    rows = np.arange(size)
    current = rows.copy()
    while True:
        alive = current >= 0
        if not alive.any():
            return visible
        visible[rows[alive], current[alive]] = True
        current = np.where(alive, parents[np.maximum(current, 0)], -1)


def walk(tree: Tree, target_argmax: np.ndarray) -> tuple[np.ndarray, int]:
    """Follow the target's greedy choices down the tree: (accepted packed indices, bonus token).

    target_argmax[i] is the target's next token after packed row i. Children are indexed
    once by (parent, token), so the walk costs O(T) to set up and O(accepted) to run.
    """
    argmax = np.asarray(target_argmax)
    if argmax.shape != (tree.size,):
        raise ValueError(f"target_argmax must have shape ({tree.size},), got {argmax.shape}")
    if argmax.dtype.kind not in "iu":
        raise ValueError(f"target_argmax must be integer token ids, got dtype {argmax.dtype}")
    choices = argmax.astype(np.int64).tolist()
    children = {
        (parent, token): index
        for index, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))
        if index > 0
    }
    path: list[int] = []
    current = 0
    while (current, choices[current]) in children:
        current = children[(current, choices[current])]
        path.append(current)
    return np.array(path, dtype=np.int64), int(choices[current])


def walked_choices(tokens: np.ndarray, depths: np.ndarray, visible: np.ndarray,
                   choose: Callable[[int], int]) -> dict[int, int]:
    """The target's token after each row `walk` will read, {row: token}, asking `choose(row)` for those rows only:
    row 0's, then the row of the child holding that token, and so on. Where choosing a row costs (a sampled row
    hashes its vocabulary), a pass pays for the accepted path and not for the whole tree; `walk` over an array
    holding these tokens at these rows (anything elsewhere) follows the same path. The tree's parents are read
    off `visible` and `depths`, as a backend receives them."""
    depths = np.asarray(depths, np.int64)
    visible = np.asarray(visible, bool)
    parent = np.argmax(visible & (depths[None, :] == depths[:, None] - 1), axis=1)
    children = {(int(parent[i]), int(t)): i for i, t in enumerate(np.asarray(tokens).tolist()) if i > 0}
    chosen = {0: choose(0)}
    current = 0
    while (current, chosen[current]) in children:
        current = children[current, chosen[current]]
        chosen[current] = choose(current)
    return chosen
