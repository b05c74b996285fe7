"""`--budget auto`: each round, how much to draft and verify, from the draft's confidence and the device's costs.

The rule, per round (D: the profile's draft ms; V(T): its verify-side ms for a T-row tree; u: the
anchor's surprisal, unknown in the first round; p, q: `Calibration`'s law and node probabilities):

1. Draft or not, and how deep. A plain greedy step yields one token in V(1). With the law's p = p(u), a
   drafted chain of m nodes is expected to yield 1 + p + ... + p^m tokens in D(d) + V(m + 1), D(d) the cost
   of a draft d >= m deep (a graph that drafts short blocks runs its head over a few rows for a shallow
   draft: `backend.block_rows`). The round drafts when that rate beats 1 / V(1) for some m <= d in 1..B-1,
   d deep: the deepest depth whose best chain's rate is within DEPTH_SLACK of the best depth's (the tree
   finds more below a depth than its one chain, so a near tie goes deeper; where every depth costs alike,
   the full depth). Otherwise it is a plain greedy step (the anchor alone). Without a fitted law it drafts
   the full depth; in the first round (no u yet) too, unless the law does not depend on u.
2. Grow and cut. Node i is accepted with probability q_i, from its path score and depth; q never rises
   from a node to its children or later siblings (b >= 0, d <= 0), so growing the tree best-first on q
   (`build_tree`'s priority) pops nodes in falling q, parents first, and its first n nodes are the n
   likeliest. n nodes are expected to yield E(n) = 1 + q_1 + ... + q_n tokens in D + V(n + 1); the round
   verifies the first n* = argmax_n E(n) / (D + V(n + 1)) nodes (the earliest n on ties; n* = 0 included).
   Growth stops early, exactly: with R* the best rate so far at n nodes and S(n) the least cost per row
   of any larger tree (min over m > n of (C(m) - C(n)) / (m - n), C(n) = D + V(n + 1)), every later node
   has q <= q_next, so if q_next <= R* S(n) no larger tree reaches R*:
   E(n) + k q_next <= R* C(n) + k R* S(n) <= R* C(n + k).

D and V are the costs `cost_watch.CostWatch` learns from the decode's own rounds (the stored profile's where
a row count or draft depth has not been timed yet), monotone in rows and depth; step 2 counts the draft at
the depth the round drafted; one round in a few, while a row count's cost is
unconfirmed, verifies up to one such count more than the rule picks, to time it (from the same growth: it grows
on past the cut only as far as that count needs). q is the calibration's node model, refitted whenever a decode
ends after LEARN_NODES more verified nodes, to this process's own acceptance (`settle`; pulled toward the stored
calibration, with b >= 0 and d <= 0 kept, so the growth order above stays exact).

The rate counts D even once the draft has run, so every round is judged as a whole, as the long-run
rate counts it. Any cut verifies a prefix-closed tree and the walk keeps the target's own choices, so
the tokens are those of greedy decoding whatever the rule picks; only the time changes.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .calibration import Calibration, find_calibration
from .cost_profile import CostProfile, load, profile_path, describe, save, stored_or_measured, PROBE_PROMPT
from .cost_watch import CostWatch
from ..defaults import AUTO, AUTO_MAX_NODES, BUDGET
from ..errors import GlanceError
from .backend import STEP_DRAFTERS
from .limits import check_branch_k, check_decode, reachable_nodes
from .loop import DecodeConfig, RoundLog
from .tree import Tree, build_tree
from ..prompt.messages import user_turn


EXPLORE_GAIN = 1.05  # an unconfirmed cost is explored only where its hopeful rate beats the pick's by this much
DEPTH_SLACK = 0.01  # a deeper draft whose best chain's rate is within this of the best depth's is taken
LEARN_NODES = 256  # verified nodes between refits of the node model to the decode's own acceptance
KEEP_NODES = 4096  # the latest verified nodes a refit sees
LEARN_PRIOR = 4.0  # how firmly a refit holds to the stored calibration (precision of its Gaussian prior)


class _Cut:
    """Step 2's running state while the tree grows: E(n) for every n grown, and the best rate so far with its node
    count. `extend`, asked once where the rule's cut is settled, names how many nodes to grow past it (an exploring
    round's larger count, timed from the same growth), or None to stop there."""

    def __init__(self, round_ms: list[float], slope: list[float],
                 extend: Callable[["_Cut"], int | None] | None = None):
        self.round_ms, self.slope, self.extend = round_ms, slope, extend
        self.expected = [1.0]  # E(n), n = 0..nodes grown
        self.best_rate, self.best_nodes = 1.0 / round_ms[0], 0
        self.q_next = 0.0  # q of the node growth last stopped at or popped (none: 0)
        self.until: int | None = None  # set where the rule's cut is settled: the nodes to grow in all

    def stop(self, nodes: int, q_next: float) -> bool:
        self.q_next = q_next
        if self.until is None and q_next <= self.best_rate * self.slope[nodes]:
            further = self.extend(self) if self.extend is not None else None
            self.until = nodes if further is None else max(nodes, further)
        if self.until is not None and nodes >= self.until:
            return True
        expected = self.expected[-1] + q_next
        self.expected.append(expected)
        rate = expected / self.round_ms[nodes + 1]
        if rate > self.best_rate:  # never past the settled cut: no larger tree reaches its rate
            self.best_rate, self.best_nodes = rate, nodes + 1
        return False


class _Rates:
    """What the rule reads of one set of costs, computed once: C(n) = D + V(n + 1) for n = 0..max_nodes (D a draft
    `depth` deep, None: the full depth), S(n), V(1), the draft's cost at each depth, and step 1's answer where the
    law does not depend on the anchor."""

    def __init__(self, cost: CostProfile, calibration: Calibration, max_nodes: int, block_size: int,
                 steps: bool = False, depth: int | None = None):
        # a tree never costs less than one of its prefixes (it does their work and more), so no cost a round reads
        # makes a larger tree look cheaper
        verify_ms = np.maximum.accumulate(cost.verify_cost(np.arange(1, max_nodes + 2)))
        round_ms = np.maximum.accumulate(cost.draft_cost(depth) + verify_ms)
        self.verify_ms = verify_ms.tolist()  # V(n + 1) for n nodes
        self.round_ms = round_ms.tolist()  # Python floats for the per-node loop
        # a step drafter (EAGLE-3) pays a head pass a depth: the profile's draft is its deepest tree's, so one
        # depth costs that over the depths it grew, and a chain of m nodes costs m of them
        self.step_ms = cost.draft_ms / max(block_size - 1, 1) if steps else None
        chain = (self.step_ms * np.arange(len(verify_ms)) + verify_ms) if steps else round_ms
        n = np.arange(len(round_ms))
        apart = n[None, :] - n[:, None]
        per_row = np.where(apart > 0, (round_ms[None, :] - round_ms[:, None]) / np.maximum(apart, 1), np.inf)
        self.slope = np.maximum(per_row.min(axis=1)[:-1], 0.0).tolist()  # S(n)
        self.chain_ms = chain.tolist()  # what a drafted chain of m nodes costs, m = 0..max_nodes
        self.plain_ms = float(cost.verify_cost(1))
        self.depth = min(block_size - 1, max_nodes)
        # a block draft d deep: what a chain of m <= d nodes costs with it is its D(d) + V(m + 1)
        self.draft_at = None if steps else np.array([cost.draft_cost(d) for d in range(1, max(self.depth, 0) + 1)])
        law = calibration.law
        constant = law is None or law[1] == 0  # the same answer every round: decided once
        self.always = self.pick(calibration.offset_acceptance(1.0)) if constant else None

    def pick(self, p: float | None, gain: float = 1.0) -> int:
        """How deep to draft: a depth at which some chain beats a plain step's rate by more than `gain` times, or
        0 for none. A block draft's depth d is judged by its best chain of m <= d nodes at D(d) + V(m + 1), and the
        deepest within DEPTH_SLACK of the best depth's rate is taken (a tree finds more below a depth than its one
        chain does); where drafts cost alike at every depth, that is the full depth. Unknown p: the full depth."""
        if p is None:
            return max(self.depth, 1)
        if self.depth < 1:  # no room for a drafted node: a draft can never pay
            return 0
        expected = 1 + np.cumsum(p ** np.arange(1, self.depth + 1))  # E(m), m = 1..depth
        if self.draft_at is None:  # a step drafter's chain of m nodes costs m head passes
            return self.depth if np.max(expected / np.array(self.chain_ms[1:self.depth + 1])) > gain / self.plain_ms \
                else 0
        verify = np.array(self.verify_ms[1:self.depth + 1])  # V(m + 1)
        rate = expected[None, :] / (self.draft_at[:, None] + verify[None, :])  # [depth d, chain m]
        best = np.max(np.tril(rate), axis=1)  # per depth, its best chain within it
        if best.max() <= gain / self.plain_ms:
            return 0
        return int(np.flatnonzero(best >= best.max() * (1 - DEPTH_SLACK))[-1]) + 1

    def wants(self, calibration: Calibration, surprisal: float | None, gain: float = 1.0) -> int:
        """Step 1 for an anchor of `surprisal`: the depth to draft, 0 for a plain step (see `pick`)."""
        if self.always is not None and gain == 1.0:
            return self.always
        if surprisal is None and self.always is None:
            return max(self.depth, 1)
        return self.pick(calibration.offset_acceptance(1.0 if self.always is not None else surprisal), gain)


def _best_prefix(accepted: Iterable[float], spent_ms: float, verify_ms: list[float]) -> tuple[float, int]:
    """The best rate E(n) / (spent + V(n + 1)) over the prefixes of nodes accepted with the given probabilities (in
    packed order, as many as `verify_ms` has counts for), and its node count (the smallest on ties)."""
    expected, best_rate, best = 1.0, 1.0 / (spent_ms + verify_ms[0]), 0
    for n, q in enumerate(accepted, start=1):
        if n >= len(verify_ms):
            break
        expected += q
        if expected / (spent_ms + verify_ms[n]) > best_rate:
            best_rate, best = expected / (spent_ms + verify_ms[n]), n
    return best_rate, best


class AutoBudget:
    """The policy for one cost profile and calibration; everything a round reads is computed here once (and
    again when `watch`, which learns costs from the decode's own rounds, changes them)."""

    def __init__(self, cost: CostProfile, calibration: Calibration, max_nodes: int, block_size: int,
                 watch: CostWatch | None = None, steps: bool = False):
        self.cost, self.calibration, self.watch = cost, calibration, watch
        self.steps = steps  # the backend is a step drafter (EAGLE-3): a head pass per depth
        self._grown = 0  # head passes the last step-drafted round ran
        self.max_nodes = max_nodes  # the largest tree auto may verify, anchor excluded
        self.block_size = block_size  # B: a drafted chain is at most B-1 deep
        self._exploring = False  # this round may verify more than the rule picks, to time an unconfirmed cost
        self._counts: list[int] = []  # the counts this round may explore, nearest first
        self._depth: int | None = None  # offsets of this round's draft
        self._futile: dict[int, list[int]] = {}  # picks whose neighbouring counts could not pay, and those counts
        self.stored_calibration = calibration  # what refits are pulled toward (`settle`)
        self._verified: list[RoundLog] = []  # drafted rounds not yet refitted from, and the nodes they verified
        self._fresh_nodes = 0
        self.depth_wanted: int | None = None  # how deep the round `should_draft` passed is to draft (None: all)
        self._use()

    def _use(self) -> None:
        self._used = self.cost if self.watch is None else self.watch.used
        self._plans: dict[int | None, _Rates] = {}
        self._hoped: dict[int | None, _Rates] = {}
        self._hoped_from: CostProfile | None = None

    def _rates(self, cost: CostProfile, depth: int | None) -> _Rates:
        return _Rates(cost, self.calibration, self.max_nodes, self.block_size, self.steps, depth)

    def _plan_at(self, depth: int | None) -> _Rates:
        """The rates with a draft `depth` deep (None: the full depth, what step 1 and a step drafter read)."""
        if depth not in self._plans:
            self._plans[depth] = self._rates(self._used, depth)
        return self._plans[depth]

    @property
    def _plan(self) -> _Rates:
        return self._plan_at(None)

    def _hope_at(self, depth: int | None) -> _Rates:
        """The rates at the hopeful costs, computed when a round that explores first asks for them (and again
        where the watch's hope has changed since: a draft whose cost is to be timed counts as free)."""
        hope = self.watch.hope
        if self._hoped_from is not hope:
            self._hoped_from, self._hoped = hope, {}
        if depth not in self._hoped:
            self._hoped[depth] = self._rates(hope, depth)
        return self._hoped[depth]

    @property
    def _hope(self) -> _Rates:
        return self._hope_at(None)

    def with_calibration(self, calibration: Calibration) -> "AutoBudget":
        return AutoBudget(self.cost, calibration, self.max_nodes, self.block_size, self.watch, self.steps)

    def should_draft(self, surprisal: float | None) -> bool:
        """Step 1: whether the law's best chain repays the draft pass (or, in a round that explores, whether it
        would with the unconfirmed costs at their most hopeful), and how deep to draft (`depth_wanted`: at the
        hopeful costs in a round that explores, so a draft whose cost is to be timed is drafted whole)."""
        wanted = self._plan.wants(self.calibration, surprisal)
        scheduled = self.watch is not None and self.max_nodes > 0 and self.watch.exploring()
        self._exploring = scheduled and bool(wanted or (
            self._hope.wants(self.calibration, surprisal, EXPLORE_GAIN) and (
                bool(self.watch.targets(1)) or self.watch.draft_unsure)))
        depth = self._hope.wants(self.calibration, surprisal) if self._exploring else wanted
        self.depth_wanted = None if self.steps or not depth or depth >= self._plan.depth else depth
        return bool(wanted) or self._exploring

    def grow(self, anchor: int, topk_ids: np.ndarray, topk_logprobs: np.ndarray, branch_k: int,
             surprisal: float | None, leaves: frozenset[int] = frozenset()) -> Tree:
        """Step 2: the round's tree from the draft's top-k, grown by q and cut at n*; in a round that explores,
        cut at the count `_explore` names instead, if any; `leaves` as in `build_tree`. One growth serves both:
        an exploring round grows on past the rule's cut only as far as a count worth timing needs."""
        self._depth = int(np.shape(topk_ids)[0])
        self._counts = []
        plan = self._plan_at(self._depth_key())
        cut = _Cut(plan.round_ms, plan.slope, self._worth if self._exploring else None)
        tree = build_tree(anchor, topk_ids, topk_logprobs, self.max_nodes, branch_k,
                          priority=self.calibration.node_scorer(surprisal), stop=cut.stop, leaves=leaves)
        pick = cut.best_nodes + 1
        if self._exploring:
            if cut.until is None:  # growth ran out before the cut settled: judge the counts on what grew
                self._worth(cut)
            explored = self._explore(pick, cut, tree)
            if explored is not None:
                return explored
        return tree.prefix(pick)

    def deeper(self, surprisal: float | None) -> Callable[[list[float], list[int], list[int]], bool]:
        """Step 2 for a step drafter (EAGLE-3), before each further head pass: whether that pass is expected to pay
        for itself. With R* the best rate of the nodes drafted so far (E(n) over the draft spent plus V(n + 1)), a
        pass expanding nodes N is expected to add sum over N of q(n) times m: a child is accepted only where its
        parent is, and then with the draft's probability of the child, whose top-k mass m this round's first pass
        measured (the anchor's top-k). The pass runs where that beats R* times its cost."""
        q = self.calibration.node_scorer(surprisal)
        plan = self._plan
        step = plan.step_ms or 0.0
        self._grown = 1

        def more(scores: list[float], depths: list[int], chosen: list[int]) -> bool:
            order = sorted(range(len(scores)), key=lambda n: (-scores[n], n))  # the tree's packed order
            best, _ = _best_prefix((q(scores[n], depths[n]) for n in order), step * self._grown, plan.verify_ms)
            mass = sum(math.exp(score) for score, depth in zip(scores, depths) if depth == 1)
            if mass * sum(q(scores[n], depths[n]) for n in chosen) <= best * step:
                return False
            self._grown += 1
            return True

        return more

    def cut(self, tree: Tree, surprisal: float | None) -> Tree:
        """Step 2 for a tree a step drafter (EAGLE-3) grew: its prefix n* = argmax E(n) / (D + V(n + 1)), D the draft
        it spent (a head pass a depth), q from each node's path score and depth (its prefixes are its best trees by
        score). The draft is spent whatever the cut, so no round explores a larger count for its cost: the costs
        are learned from the counts the rule picks."""
        self._depth = self.block_size - 1 if tree.size > 1 else None
        self._counts = []
        q = self.calibration.node_scorer(surprisal)
        nodes = (q(s, d) for s, d in zip(tree.scores[1:].tolist(), tree.depths[1:].tolist()))
        _, best = _best_prefix(nodes, (self._plan.step_ms or 0.0) * max(self._grown, 1), self._plan.verify_ms)
        return tree.prefix(best + 1)

    def _depth_key(self) -> int | None:
        """This round's draft depth as the rates are keyed: None where it drafted the full depth."""
        return None if self._depth is None or self._depth >= self._plan.depth else self._depth

    def _worth(self, cut: _Cut) -> int | None:
        """The unconfirmed counts beside the rule's pick that could beat its rate at the hopeful costs, kept for
        `_explore`, and the nodes to grow for the largest (None: none needs more). A node not grown yet is
        bounded by the q growth stopped at (q never rises in growth order); counts judged in vain for the same
        pick before are left."""
        pick, rate, hope = cut.best_nodes + 1, cut.best_rate * EXPLORE_GAIN, self._hope_at(self._depth_key()).round_ms
        grown = len(cut.expected) - 1
        counts = [g for g in self.watch.targets(pick) if g <= self.max_nodes + 1 and (
            cut.expected[min(g - 1, grown)] + max(g - 1 - grown, 0) * cut.q_next) / hope[g - 1] > rate]
        self._counts = [] if self._futile.get(pick) == counts else counts
        return max(self._counts) - 1 if self._counts else None

    def _explore(self, pick: int, cut: _Cut, tree: Tree) -> Tree | None:
        """The tree of the first count `_worth` kept whose expected tokens, at the hopeful cost, beat the pick's
        rate (None where none does: those counts are then left for this pick)."""
        rate, hope = cut.best_rate * EXPLORE_GAIN, self._hope_at(self._depth_key()).round_ms
        for rows in self._counts:
            if rows <= tree.size and cut.expected[rows - 1] / hope[rows - 1] > rate:
                return tree.prefix(rows)
        if self._counts:
            self._futile[pick] = self._counts
        return None

    def observe(self, round_log: RoundLog) -> None:
        """The round's own timings: the costs of its shape are learned from them (see `cost_watch`); its verified
        nodes are kept for the next refit of acceptance (`settle`)."""
        if round_log.drafted and round_log.node_scores:
            self._verified.append(round_log)
            self._fresh_nodes += len(round_log.node_scores)
        if self.watch is None:
            return
        drafted = round_log.drafted
        draft_ms = round_log.draft_ms
        if drafted and self.steps and self._grown:  # a step drafter's draft, per pass, as if it had grown full depth
            draft_ms *= (self.block_size - 1) / self._grown
        if self.watch.observe(round_log.tree_size, round_log.total_ms - round_log.draft_ms,
                              draft_ms if drafted else None, self._depth if drafted else None):
            self._use()

    def settle(self) -> None:
        """The decode has ended (off its clock): what its rounds taught about the costs is refitted and stored for
        later runs (see `cost_watch`), and once LEARN_NODES more nodes have been verified, the node model is refitted to the
        latest KEEP_NODES of them: how often this device's drafts of these prompts are accepted, where the stored
        calibration was fitted on others (a tree's end cut by the answer's end counts, as it costs)."""
        if self.watch is not None and self.watch.settle():
            self._use()
        if self._fresh_nodes < LEARN_NODES:
            return
        kept, nodes = [], 0
        for round_log in reversed(self._verified):
            if nodes >= KEEP_NODES:
                break
            kept.append(round_log)
            nodes += len(round_log.node_scores)
        self._verified, self._fresh_nodes = kept[::-1], 0
        scores = np.concatenate([r.node_scores for r in self._verified])
        depths = np.concatenate([r.node_depths for r in self._verified])
        surprisals = np.concatenate([np.full(len(r.node_scores), np.nan if r.surprisal is None else r.surprisal)
                                     for r in self._verified])
        accepted = np.concatenate([np.isin(np.arange(1, len(r.node_scores) + 1), r.path) for r in self._verified])
        self.calibration = self.stored_calibration.refitted(scores, depths, surprisals, accepted, LEARN_PRIOR)


def has_profile(runner) -> bool:
    return load(profile_path(runner.home, runner.identity, describe(runner.backend))) is not None


def default_budget(runner) -> int | str:
    """auto where a cost profile exists or is measured on first use (the exported graphs and engines),
    else the fixed default (the torch reference, a development path)."""
    graphs = runner.backend.name != "torch"
    return AUTO if runner.backend.block_size > 1 and (graphs or has_profile(runner)) else BUDGET


def auto_budget(runner, branch_k: int, remeasure: bool = False,
                progress: Callable[[str], None] = lambda _: None) -> tuple[AutoBudget, Path | None, Path | None]:
    """The policy for this runner: its cost profile (stored or measured now) and the calibration found
    beside its artifacts, engines or head (else the prior). Returns the profile's path (None: kept in memory
    for this run) and the calibration's too."""
    backend, limits = runner.backend, runner.limits
    if backend.block_size < 2:
        raise GlanceError("--budget auto needs a draft head; pass --head (or a fixed --budget with --no-spec)")
    check_branch_k(limits, branch_k)
    largest = min(AUTO_MAX_NODES, reachable_nodes(backend.block_size, branch_k, backend.info.limits.drafter))
    if limits.max_tree is not None:
        largest = min(largest, limits.max_tree - 1)
    probe = lambda: runner.build([user_turn(PROBE_PROMPT)])  # noqa: E731 (not length-checked: cut to fit)
    cost, cost_path = stored_or_measured(backend, runner.home, runner.identity, probe, largest + 1, branch_k,
                                         remeasure=remeasure, progress=progress)
    calibration, calibration_path = find_calibration(list(runner.calibration_dirs))
    max_nodes = min(largest, cost.max_rows - 1)
    watch = CostWatch(cost, _keeper(cost_path, progress), max_nodes + 1, backend.block_size - 1)
    policy = AutoBudget(cost, calibration, max_nodes, backend.block_size, watch,
                        steps=backend.info.limits.drafter in STEP_DRAFTERS)
    return policy, cost_path, calibration_path


def _keeper(path: Path | None, progress: Callable[[str], None]) -> Callable[[CostProfile], None]:
    """How refined profiles are stored for later runs: at `path`; nowhere where the profile is kept in memory
    (said once already) or once a write has failed (a failed write costs only that). Each is said once."""
    failed, said = path is None, False

    def keep(profile: CostProfile) -> None:
        nonlocal failed, said
        if failed:
            return
        try:
            save(profile, path)
        except GlanceError as exc:
            failed = True
            progress(f"cost profile not updated: {exc}")
            return
        if not said:
            said = True
            progress(f"cost profile refined from this decode's round timings in {path}")

    return keep


def decode_config(runner, budget: int | str | None, *, max_new_tokens: int, branch_k: int,
                  speculative: bool = True, remeasure: bool = False,
                  progress: Callable[[str], None] = lambda _: None) -> DecodeConfig:
    """The commands' DecodeConfig: a fixed budget as given, or auto (asked for, or the default where it applies),
    refused here where the backend cannot serve it (auto's trees fit by construction). `remeasure`: auto's
    cost profile is measured again, not read."""
    if budget is None:
        budget = default_budget(runner) if speculative else BUDGET
    if budget != AUTO or not speculative:
        cfg = DecodeConfig(max_new_tokens=max_new_tokens, budget=budget if budget != AUTO else BUDGET,
                           branch_k=branch_k, speculative=speculative)
        check_decode(runner.limits, cfg)
        return cfg
    policy = auto_budget(runner, branch_k, remeasure=remeasure, progress=progress)[0]
    return DecodeConfig(max_new_tokens=max_new_tokens, budget=policy.max_nodes, branch_k=branch_k, auto=policy)
