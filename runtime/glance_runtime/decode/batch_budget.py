"""`--budget auto` for a batch: each round's trees chosen for the batch's tokens per second.

One sequence's auto (`auto_budget`) weighs a tree against its own round; in a batch every sequence shares the
round, and what a drafted node costs is what it adds to the batch's pass. The round's cost is modelled as

    ms(B, W, rows, drafted) = A + S * B + R * (B * (W - 1) + rows - B) + K * drafted + K0 * [drafted > 0]

B: sequences in the round; W: its widest tree (the verify pass is padded: every sequence computes W rows);
rows: every sequence's tree, anchors included, so rows - B drafted nodes are projected, walked and committed;
drafted: sequences whose block the head drafts. A sequence's own cost (its anchor row, gathers, commit and
bookkeeping) is S, apart from what a drafted node adds. A, S, K and K0 are fitted by least squares to the
batch's own rounds (recent ones weigh more), pulled toward a start taken from the single-sequence cost profile.
R is not fitted: it is the profile's mean cost a row, which timed trees of every size, on this process's scale
(times the fitted A + S over the profile's one-row verify); K and K0 start from the profile's draft on that
scale too, so the first drafting rounds are judged at this machine's costs. In a batch the nodes grow with the drafted sequences
(the law that picks them also sizes their trees), so the batch's rounds cannot tell a node's cost from a draft's:
fitted freely on the default model at 8 sequences, R came out 0.7 to 1.3 ms, where trees of 4, 8 and 16 nodes a
sequence timed 0.06 ms a node; and a model with one cost a row for anchors and nodes alike charged every node with
a sequence's overhead. Each sequence yields at least its bonus token, so a round of B plain steps yields B tokens.

1. Draft or not (before the head runs). From the law's per-offset acceptance p(u) of a sequence's anchor, a
   chain of m nodes is expected to add p + ... + p^m tokens. Sequences are taken in falling p; one is drafted
   when the batch's expected rate with its best chain beats the rate without it; in a sequence's first round
   (no u yet) p is taken at the calibration's mean surprisal. Without a law the sequence drafts, as one
   sequence's auto does.
2. Grow and cut (after). Every drafted sequence's tree is grown best-first on the calibration's node probability
   q, which never rises along a sequence's growth order, so taking nodes of all sequences in falling q takes, for
   each total, the likeliest nodes; the round keeps nodes while the next one's q beats the rate it would lower
   (q > rate * the ms it adds: R for a node inside the widest tree, R * (B + 1) for one that widens the pass),
   the drafts already paid counted in the rate as the single rule counts them. A tree grows only while its next
   node could beat the plain round's rate at the least a node adds (R): the cut keeps no node past that.
As B grows, a padded level (R * B) and K * drafted grow against a fixed gain per node, so trees shrink toward
plain steps exactly where the batched pass stops being nearly free.

3. Drafting at all. A round's rate is not the whole story: requests join between rounds, each with a prefill the
   others wait for, so where joins are what limits the batch, shorter rounds serve more requests and fewer rounds
   a request buy nothing. `ModeSwitch` therefore measures what rounds with drafts and rounds of plain steps give
   in tokens per second of wall time (the joins between them included), over windows of rounds, and keeps the
   better. It starts with plain steps. A mode's rate pools its latest KEPT_WINDOWS windows, and the other mode is
   taken only where it measured SWITCH_MARGIN faster (a window's time swings by a tenth on a shared machine).
   The window after a change of mode is not kept: it runs on the batch the other mode left (plain steps fill the
   batch, one request joining a boundary; a drafting window then finishes those sequences at a rate drafting
   could not sustain), so a look at the other mode takes two windows, once in EXPLORE_WINDOWS kept ones, and a
   batch loses about 2 / EXPLORE_WINDOWS of the gap to the better choice while it checks whether the load changed.
   (With each window's rate deciding alone, none skipped and the earlier cost model, glance-serve at 8 clients
   ran 4.5% below plain steps over 5 alternations.)
Only the time changes: every tree is verified whole and the walk keeps the target's own choices.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Sequence

import numpy as np

from .calibration import Calibration
from .cost_profile import MIN_MS
from .tree import Tree

DECAY = 0.97  # weight of a round's timing, per later round: about the last 30 rounds count
PRIOR_WEIGHT = 4.0  # how many rounds' worth the start holds against the batch's own timings
EXPLORE_EVERY = 128  # drafting allowed yet declined this many rounds in a row: the likeliest sequence drafts once,
# to time the drafts again (each costs a head pass and, as a request's first draft, its prompt's absorption)
WINDOW_ROUNDS = 8  # rounds a drafting-or-not choice is measured over
EXPLORE_WINDOWS = 32  # one kept window in this many tries the choice that measured worse
KEPT_WINDOWS = 4  # a mode's rate pools its latest this many windows (one window's noise does not flip it)
SWITCH_MARGIN = 0.03  # the other mode is taken only where it measured this much faster
FITTED = [0, 1, 3, 4]  # A, S, K, K0: the coefficients the batch's rounds refit (R, index 2, is scaled)
PRIOR = PRIOR_WEIGHT * np.diag([1.0, 16.0, 4.0, 1.0])  # counts vary most: their priors weigh like it


class BatchCost:
    """The round-cost model (A, S, R, K, K0), refitted when next read after rounds were observed (a round of plain
    steps on a small model costs a couple of ms: a refit a round, unread, was a few percent of it)."""

    def __init__(self, start: Sequence[float]):
        self.start = np.maximum(np.asarray(start, dtype=float), 0.0)
        self.xtx = np.zeros((4, 4))
        self.xty = np.zeros(4)
        self._theta = self.start.copy()
        self._stale = False

    @property
    def theta(self) -> np.ndarray:
        if self._stale:
            self._refit()
        return self._theta

    @staticmethod
    def _x(sequences: int, width: int, rows: int, drafted: int) -> np.ndarray:
        return np.array([1.0, sequences, sequences * (width - 1) + rows - sequences, drafted, float(drafted > 0)])

    def ms(self, sequences: int, width: int, rows: int, drafted: int) -> float:
        """A round's modelled cost; never below a profile's resolution (rounds timed below what the unfitted R
        says pull the fitted coefficients to zero, and a rate is tokens over this)."""
        return max(float(self._x(sequences, width, rows, drafted) @ self.theta), MIN_MS)

    def chain_ms(self, sequences: int, width: int, rows: int, drafted: int, cap: int) -> np.ndarray:
        """ms with one more drafted sequence whose chain has m = 1..cap nodes (`ms` for each, at once)."""
        a, s, r, k, k0 = self.theta.tolist()
        m = np.arange(1, cap + 1)
        padded = sequences * (np.maximum(width, m + 1) - 1) + rows + m - sequences
        return np.maximum(a + s * sequences + r * padded + k * (drafted + 1) + k0, MIN_MS)

    @property
    def per_row(self) -> float:
        return float(self.theta[2])

    def scale(self) -> float:
        """This process's ms per profile ms: the fitted one-sequence plain round over the profile's one-row verify."""
        one = self.start[0] + self.start[1]
        theta = self.theta
        return float(theta[0] + theta[1]) / one if one > 0 else 1.0

    def observe(self, sequences: int, width: int, rows: int, drafted: int, ms: float) -> None:
        nodes = sequences * (width - 1) + rows - sequences
        free = np.array([1.0, sequences, drafted, float(drafted > 0)])
        self.xtx = DECAY * self.xtx + np.outer(free, free)
        self.xty = DECAY * self.xty + free * (ms - nodes * self._theta[2])
        self._stale = True

    def _refit(self) -> None:
        self._stale = False
        scale = self.scale()
        centre = self.start[FITTED] * np.array([1.0, 1.0, scale, scale])  # the drafts at this machine's scale
        fitted = np.linalg.solve(self.xtx + PRIOR, self.xty + PRIOR @ centre)
        self._theta[FITTED] = np.maximum(fitted, 0.0)
        self._theta[2] = self.start[2] * self.scale()


def start_from_profile(verify_ms: Sequence[float], draft_ms: float) -> tuple[float, float, float, float, float]:
    """A, S, R, K, K0 from one sequence's costs (V(T) for T = 1.., D): a row (a sequence's anchor or a drafted
    node) costs V's mean slope, the rest of V(1) is the round's own; a drafted sequence costs one draft, and so
    does a batched head pass of its own (its launch, the projection of its rows)."""
    v = np.asarray(verify_ms, dtype=float)
    per_row = float(max((v[-1] - v[0]) / max(len(v) - 1, 1), 0.0))
    return max(float(v[0]) - per_row, 0.0), per_row, per_row, float(draft_ms), float(draft_ms)


class ModeSwitch:
    """Whether the batch drafts at all, from the tokens per second each choice gave over its latest windows."""

    def __init__(self) -> None:
        self.drafting = False  # plain steps first: the batch is never slower than them while it measures drafts
        self.kept: dict[bool, deque[tuple[int, float]]] = {mode: deque(maxlen=KEPT_WINDOWS) for mode in (False, True)}
        self.choice = False  # the mode run between looks at the other
        self.windows = 0  # windows kept
        self._settling = False  # the window under way follows a change of mode: not kept
        self._tokens, self._ms, self._rounds = 0, 0.0, 0

    def rate(self, drafting: bool) -> float | None:
        """Tokens per ms over the mode's kept windows (None: not measured yet)."""
        kept = self.kept[drafting]
        return sum(t for t, _ in kept) / max(sum(ms for _, ms in kept), 1e-9) if kept else None

    def observe(self, tokens: int, ms: float) -> None:
        """A round's tokens (and its joins') over the wall time since the last round ended."""
        self._tokens, self._ms, self._rounds = self._tokens + tokens, self._ms + ms, self._rounds + 1
        if self._rounds < WINDOW_ROUNDS:
            return
        window, self._tokens, self._ms, self._rounds = (self._tokens, self._ms), 0, 0.0, 0
        if self._settling:  # the batch the other mode left behind: the next window measures this one
            self._settling = False
            return
        self.kept[self.drafting].append(window)
        self.windows += 1
        untried = [mode for mode in (False, True) if not self.kept[mode]]
        if untried:
            after = untried[0]
        else:
            other = not self.choice
            if self.rate(other) > self.rate(self.choice) * (1 + SWITCH_MARGIN):
                self.choice = other
            after = other if self.windows % EXPLORE_WINDOWS == 0 else self.choice
        self._settling = after != self.drafting
        self.drafting = after


class BatchBudget:
    """The batch's policy: which sequences draft, then how much of each tree to verify."""

    def __init__(self, cost: BatchCost, calibration: Calibration, max_nodes: int):
        self.cost, self.calibration, self.max_nodes = cost, calibration, max_nodes
        self.switch = ModeSwitch()
        self._idle = 0  # rounds in a row without a draft

    def plan(self, surprisals: Sequence[float | None], caps: Sequence[int | None]) -> list[int | None]:
        """Per sequence, the depth to draft (its cap) or None for a plain step; `caps` None: no draft possible."""
        count = len(caps)
        out: list[int | None] = [None] * count
        if not self.switch.drafting:
            return out
        expected, rows, drafted, width = float(count), count, 0, 1
        likely = []
        for i, (u, cap) in enumerate(zip(surprisals, caps)):
            if cap is None or cap < 1:
                continue
            p = self.calibration.offset_acceptance(self.calibration.surprisal_mean if u is None else u)
            if p is None:  # no law: drafted, its worth left to the cut
                out[i], drafted = cap, drafted + 1
                continue
            likely.append((-p, i, cap))
        cost = self.cost
        for negative_p, i, cap in sorted(likely):
            p = -negative_p
            gains = np.cumsum(p ** np.arange(1, cap + 1))
            rates = (expected + gains) / cost.chain_ms(count, width, rows, drafted, cap)
            best = int(np.argmax(rates))
            if rates[best] > expected / cost.ms(count, width, rows, drafted):
                out[i] = cap
                expected, rows, drafted = expected + float(gains[best]), rows + best + 1, drafted + 1
                width = max(width, best + 2)
        if drafted or not likely:
            self._idle = 0
        else:
            self._idle += 1
            if self._idle >= EXPLORE_EVERY:
                _, i, cap = min(likely)
                out[i], self._idle = cap, 0
        return out

    def growth_stop(self, sequences: int) -> Callable[[int, float], bool]:
        """`build_tree`'s stop for a drafted tree in a round of `sequences`: its next node is grown only where it
        could beat the plain round's rate at the least a node adds (R); the cut would keep none past that."""
        plain = self.cost.ms(sequences, 1, sequences, 0)
        floor = sequences / max(plain, 1e-9) * self.cost.per_row
        return lambda nodes, q_next: q_next <= floor

    def cut(self, trees: Sequence[Tree], surprisals: Sequence[float | None], drafted: int) -> list[Tree]:
        """Each tree cut to the prefix the batch's rate picks (a plain step's tree stays the anchor alone)."""
        count = rows = len(trees)
        expected, width = float(rows), 1
        queues = []
        for i, (tree, u) in enumerate(zip(trees, surprisals)):
            if tree.size > 1:
                q = self.calibration.node_probability(tree.scores[1:], u, tree.depths[1:])
                queues.append((q.tolist(), i))
        if not queues:
            return list(trees)
        kept = [0] * len(trees)
        heap = [(-q[0], i, 0, q) for q, i in queues]
        heapq.heapify(heap)
        cost, per_node = self.cost, self.cost.per_row
        while heap:
            negative_q, i, at, q = heapq.heappop(heap)
            wider = max(width, at + 2)
            added = per_node * (count * (wider - width) + 1)  # the node's row, and a padded row a sequence to widen
            if -negative_q <= expected / cost.ms(count, width, rows, drafted) * added or -negative_q <= 0.0:
                break
            expected, rows, kept[i], width = expected - negative_q, rows + 1, at + 1, wider
            if at + 1 < len(q):
                heapq.heappush(heap, (-q[at + 1], i, at + 1, q))
        return [tree.prefix(1 + kept[i]) if tree.size > 1 else tree for i, tree in enumerate(trees)]

    def observe(self, sequences: int, width: int, rows: int, drafted: int, ms: float) -> None:
        self.cost.observe(sequences, width, rows, drafted, ms)
