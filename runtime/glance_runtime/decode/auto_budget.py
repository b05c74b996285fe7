"""`--budget auto`: each round, how much to draft and verify, from the draft's confidence and the device's costs.

The rule, per round (D: the profile's draft ms; V(T): its verify-side ms for a T-row tree; u: the
anchor's surprisal, unknown in the first round; p, q: `Calibration`'s law and node probabilities):

1. Draft or not. A plain greedy step yields one token in V(1). With the law's p = p(u), a drafted chain of
   m nodes is expected to yield 1 + p + ... + p^m tokens in D + V(m + 1). The round drafts when that
   rate beats 1 / V(1) for some m in 1..B-1; otherwise it is a plain greedy step (the anchor alone).
   Without a fitted law it drafts; in the first round (no u yet) too, unless the law does not depend on u.
2. Grow and cut. Node i is accepted with probability q_i, from its path score and depth; q never rises
   from a node to its children or later siblings (b >= 0, d <= 0), so growing the tree best-first on q
   (`build_tree`'s priority) pops nodes in falling q, parents first, and its first n nodes are the n
   likeliest. n nodes are expected to yield E(n) = 1 + q_1 + ... + q_n tokens in D + V(n + 1); the round
   verifies the first n* = argmax_n E(n) / (D + V(n + 1)) nodes (the earliest n on ties; n* = 0 included).
   Growth stops early, exactly: with R* the best rate so far at n nodes and S(n) the least cost per row
   of any larger tree (min over m > n of (C(m) - C(n)) / (m - n), C(n) = D + V(n + 1)), every later node
   has q <= q_next, so if q_next <= R* S(n) no larger tree reaches R*:
   E(n) + k q_next <= R* C(n) + k R* S(n) <= R* C(n + k).

The rate counts D even once the draft has run, so every round is judged as a whole, as the long-run
rate counts it. Any cut verifies a prefix-closed tree and the walk keeps the target's own choices, so
the tokens are those of greedy decoding whatever the rule picks; only the time changes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from .calibration import Calibration, find_calibration
from .cost_profile import CostProfile, load, profile_path, describe, save, stored_or_measured, PROBE_PROMPT
from .cost_watch import PROBE_ROWS, CostWatch
from ..defaults import AUTO, AUTO_MAX_NODES, BUDGET
from ..errors import GlanceError
from .limits import check_branch_k, check_decode, reachable_nodes
from .loop import DecodeConfig, RoundLog
from .tree import Tree, build_tree
from ..prompt.messages import user_turn


class _Cut:
    """Step 2's running state while the tree grows: E(n), and the best rate so far with its node count."""

    def __init__(self, round_ms: list[float], slope: list[float]):
        self.round_ms, self.slope = round_ms, slope
        self.expected, self.best_rate, self.best_nodes = 1.0, 1.0 / round_ms[0], 0

    def stop(self, nodes: int, q_next: float) -> bool:
        if q_next <= self.best_rate * self.slope[nodes]:
            return True
        self.expected += q_next
        rate = self.expected / self.round_ms[nodes + 1]
        if rate > self.best_rate:
            self.best_rate, self.best_nodes = rate, nodes + 1
        return False


class AutoBudget:
    """The policy for one cost profile and calibration; everything a round reads is computed here once (and
    again when `watch`, the decode's own timings, corrects the profile)."""

    def __init__(self, cost: CostProfile, calibration: Calibration, max_nodes: int, block_size: int,
                 watch: CostWatch | None = None):
        self.calibration, self.watch = calibration, watch
        self.max_nodes = max_nodes  # the largest tree auto may verify, anchor excluded
        self.block_size = block_size  # B: a drafted chain is at most B-1 deep
        self._probe_round = False  # this round drafts only to time the profile's smallest tree
        self._use(cost)

    def _use(self, cost: CostProfile) -> None:
        self.cost = cost
        rows = np.arange(1, self.max_nodes + 2)
        # C(n) = D + V(n+1), n = 0..max_nodes; a tree never costs less than one of its prefixes (it does their
        # work and more), so a noisy profile or a partial correction cannot make a larger tree look cheaper
        self._round_ms = np.maximum.accumulate(cost.draft_ms + cost.verify_cost(rows))
        self._round_list = self._round_ms.tolist()  # Python floats for the per-node loop
        slope = [min((self._round_ms[m] - self._round_ms[n]) / (m - n) for m in range(n + 1, len(self._round_ms)))
                 for n in range(len(self._round_ms) - 1)]
        self._slope_list = [max(float(v), 0.0) for v in slope]  # S(n)
        self._plain_ms = float(cost.verify_cost(1))
        law = self.calibration.law
        constant = law is None or law[1] == 0  # the same answer every round: decided once
        self._always = self._repays(self.calibration.offset_acceptance(1.0)) if constant else None

    def with_calibration(self, calibration: Calibration) -> "AutoBudget":
        return AutoBudget(self.cost, calibration, self.max_nodes, self.block_size, self.watch)

    def _repays(self, p: float | None) -> bool:
        if p is None:
            return True
        depth = min(self.block_size - 1, self.max_nodes)
        if depth < 1:  # no room for a drafted node: a draft can never pay
            return False
        expected = 1 + np.cumsum(p ** np.arange(1, depth + 1))
        return bool(np.max(expected / self._round_ms[1:depth + 1]) > 1 / self._plain_ms)

    def _probing(self) -> bool:
        return self.watch is not None and self.max_nodes >= PROBE_ROWS - 1 and self.watch.probing()

    def should_draft(self, surprisal: float | None) -> bool:
        """Step 1: whether the law's best chain repays the draft pass (or the profile's smallest tree is
        still to be checked against this decode's timings: then the round drafts as a probe)."""
        if self._always is not None:
            wanted = self._always
        else:
            wanted = surprisal is None or self._repays(self.calibration.offset_acceptance(surprisal))
        self._probe_round = not wanted and self._probing()
        return wanted or self._probe_round

    def grow(self, anchor: int, topk_ids: np.ndarray, topk_logprobs: np.ndarray, branch_k: int,
             surprisal: float | None, leaves: frozenset[int] = frozenset()) -> Tree:
        """Step 2: the round's tree from the draft's top-k, grown by q and cut at n* (a probe keeps the
        anchor and the best node where n* is 0); `leaves` as in `build_tree`."""
        cut = _Cut(self._round_list, self._slope_list)
        priority = self.calibration.node_scorer(surprisal)
        tree = build_tree(anchor, topk_ids, topk_logprobs, self.max_nodes, branch_k, priority=priority,
                          stop=cut.stop, leaves=leaves)
        if self._probe_round or (cut.best_nodes == 0 and self._probing()):
            return build_tree(anchor, topk_ids, topk_logprobs, PROBE_ROWS - 1, branch_k, priority=priority,
                              leaves=leaves)
        return tree.prefix(cut.best_nodes + 1)

    def observe(self, round_log: RoundLog) -> None:
        """The round's own timings: where they contradict the cost profile, it is corrected from them."""
        if self.watch is None:
            return
        verify_ms = round_log.total_ms - round_log.draft_ms
        corrected = self.watch.observe(round_log.tree_size, verify_ms,
                                       round_log.draft_ms if round_log.drafted else None)
        if corrected is not None:
            self._use(corrected)


def has_profile(runner) -> bool:
    return load(profile_path(runner.home, runner.identity, describe(runner.backend))) is not None


def default_budget(runner) -> int | str:
    """auto where a cost profile exists or is measured on first use (the exported graphs and engines),
    else the fixed default (the torch reference, a development path)."""
    graphs = runner.backend.name != "torch"
    return AUTO if runner.backend.block_size > 1 and (graphs or has_profile(runner)) else BUDGET


def auto_budget(runner, branch_k: int, remeasure: bool = False,
                progress: Callable[[str], None] = lambda _: None) -> tuple[AutoBudget, Path, Path | None]:
    """The policy for this runner: its cost profile (stored or measured now) and the calibration found
    beside its artifacts, engines or head (else the prior). Returns the profile's and calibration's paths too."""
    backend, limits = runner.backend, runner.limits
    if backend.block_size < 2:
        raise GlanceError("--budget auto needs a draft head; pass --head (or a fixed --budget with --no-spec)")
    check_branch_k(limits, branch_k)
    largest = min(AUTO_MAX_NODES, reachable_nodes(backend.block_size, branch_k))
    if limits.max_tree is not None:
        largest = min(largest, limits.max_tree - 1)
    probe = lambda: runner.build([user_turn(PROBE_PROMPT)])  # noqa: E731 (not length-checked: cut to fit)
    cost, cost_path = stored_or_measured(backend, runner.home, runner.identity, probe, largest + 1, branch_k,
                                         remeasure=remeasure, progress=progress)
    calibration, calibration_path = find_calibration(list(runner.calibration_dirs))
    watch = CostWatch(cost, lambda corrected: _store(corrected, cost_path, progress))
    policy = AutoBudget(cost, calibration, min(largest, cost.max_rows - 1), backend.block_size, watch)
    return policy, cost_path, calibration_path


def _store(profile: CostProfile, path: Path, progress: Callable[[str], None]) -> None:
    """A profile the decode corrected or checked, stored for later runs (a failed write costs only that)."""
    try:
        save(profile, path)
    except GlanceError as exc:
        progress(f"cost profile not updated: {exc}")
        return
    progress(f"cost profile updated from this decode's round timings in {path}")


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
