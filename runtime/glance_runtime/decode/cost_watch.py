"""The costs `--budget auto` weighs, learned from the decode's own rounds, and the stored profile they refine.

A profile is measured once per device and stored; one busy moment while it was measured can make trees look
many times dearer than they are, and a tree auto therefore never verifies would never be timed again. So the
costs a round is decided with are the decode's own wherever it has them:
- Observed: every round's verify-side time (mask, verify, walk, commit) is kept under its exact row count, and
  a drafted round's draft time under its draft depth (the last WINDOW of each); the fastest counts, since other
  processes only ever add time. The first round of a process pays first runs and is not kept. A shallower
  draft's time is used where the profile timed drafts by depth (a graph that drafts short blocks), as its
  share of the full draft's; the full draft's is what is confirmed and stored.
- Used (`used`): an observed row count at its fastest time, the moment it is timed (but a count between
  measured ones timed once only lowers its cost: one slow round is more likely another process than the
  device, and such a count is never explored, while a measured one is until confirmed); a measured count not
  observed yet at the profile's cost scaled as the nearest observed count below it came out (so a machine
  uniformly slower than when measured changes no choice), unless that count came out more than CONTRADICTS
  times cheaper than the profile says relative to the smallest observed one: then the profile's growth above
  it is suspect and those counts cost what it does (erring cheap is safe: a tree dearer than thought is
  verified, timed and corrected in that round; one thought too dear would never be tried). Then made monotone
  in rows by the running minimum from above.
- Confirmed: a measured count timed in CONFIRM rounds of exactly its rows whose fastest two agree within AGREE
  (one slow round cannot confirm a cost), in this process or, stored as checked_rows, in an earlier one; the
  draft likewise, at its full depth (draft_checked). An earlier process's confirmations hold only while this
  one's rounds come out on the profile's scale: where the live scale is CONTRADICTS or more off it (the profile
  was stored on a machine busy otherwise than now, or timed in another way), they are dropped, this process's
  own kept, and every count not confirmed here is explored as an unconfirmed one is. (A profile found on a
  machine, every count checked at one row 3x cheaper than this process's and trees of 8 to 64 rows 14 to 143
  times one row, kept its auto from ever drafting, where trees of 16 rows gave 1.4x plain steps.) A cost whose fastest came out CONTRADICTS times dearer than
  stored (at the live scale), or a count dearer than PLAUSIBLE_PER_ROW one-row verifies per row, needs
  CONFIRM_DEAR rounds: on a crowded machine two rounds slowed alike do happen, and a cost confirmed too dear would
  never be timed again.
- Explored: while a count is unconfirmed, one round in EVERY verifies exactly the first unconfirmed count above
  or below auto's pick (`targets`, the nearer first) that would beat the pick's rate were every unconfirmed
  count as cheap as the confirmed count below it and an unconfirmed draft free (`hope`), if either does; and
  while the draft's cost is unconfirmed, such a round drafts where that hope says a draft could pay. A confirmed
  draft counts as unconfirmed here until this process has timed one, and again after REDRAFT rounds without
  one (`draft_unsure`): two drafted rounds slowed alike can confirm a draft too dear, and auto would then never
  draft, so never time it, again (a draft stored at 3-10x its cost kept the demo at tau 1.0 run after run). A count
  thought dear is thus timed again until two rounds agree on it, and one that could not pay however cheap is
  never tried. The tokens are greedy's whatever is verified; docs/auto-budget.md bounds the time this costs.
- Refitted: `used` and `hope` are recomputed at once where a count is newly confirmed or a cost moved by
  CONTRADICTS or more; a smaller move (more than NOTICE) waits until REFIT_GAP rounds have passed since the last
  refit, and is then applied with whatever else was learned meanwhile (a refit costs several rounds' tree growth,
  and so small a move changes few choices).
- Stored: the used costs, at the profile's own scale (never below its resolution, `cost_profile.MIN_MS`), after a
  refit and when a decode ends (`settle`, off its clock, with any smaller move still waiting), where a count was
  newly confirmed or a measured count's cost (or the draft's) moved by more than RESTORE (after FREE_STORES, at
  most once in STORE_GAP rounds); a provisional profile stays marked so until every count above the smallest the
  decode verified is confirmed. (Writing only
  when a decode ends was tried: beside 4 CPU burners the demo's recovery from a poisoned profile then failed
  more often, 2 of 10 tries against 0 of 10, as if the rounds' timings fared better for the process's pauses
  on the disk.)
"""
from __future__ import annotations

import bisect
import math
from dataclasses import replace
from typing import Callable

import numpy as np

from ..formats.cost import PLAUSIBLE_PER_ROW, CostProfile
from .cost_profile import MIN_MS, kept_ms

EVERY = 2  # at most one round in EVERY explores
CONFIRM = 2  # rounds of exactly a measured count's rows before its cost may count as confirmed
CONFIRM_DEAR = 4  # ... where they came out CONTRADICTS times dearer than stored (at the live scale) or implausibly dear
AGREE = 1.5  # ... and how close their fastest two must be
WINDOW = 9  # the latest rounds of one row count (or draft depth) that count
REDRAFT = 128  # declined rounds after which a confirmed draft cost is timed again (and once early in each process)
CONTRADICTS = 2.0  # a count this many times cheaper than the profile says makes the profile's growth above it suspect
RESTORE = 1.25  # a learned cost this far off the stored one (either way) is stored
NOTICE = 0.1  # a fastest time that moved less than this (relatively) changes no used cost
REFIT_GAP = 16  # a move of less than CONTRADICTS is applied once this many rounds have passed since the last refit
# (a refit costs a few rounds' tree growth; confirmations and larger moves are applied at once)
FREE_STORES, STORE_GAP = 8, 32  # stores at once in one process, then at most one in STORE_GAP rounds (a write
# waits for the disk: a long decode need not pay for every small refinement)


def _moved(before: float, after: float) -> float:
    """How far a cost moved, as a ratio >= 1 (1: not at all)."""
    return max(after / before, before / after)


def _keep(windows: dict[int, list[float]], key: int, value: float) -> float:
    """Add `value` to `key`'s window; how far its fastest moved (`math.inf` where it is new)."""
    kept = windows.setdefault(key, [])
    before = min(kept) if kept else None
    kept.append(value)
    del kept[:-WINDOW]
    return math.inf if before is None else _moved(before, min(kept))


class CostWatch:
    """One decoding process's costs: `used` and `hope` (see the module), learned from the rounds it is shown;
    `store` saves a refined profile. `max_rows`: the largest tree auto may verify; `full_depth`: the deepest
    draft, whose cost is the profile's draft cost."""

    def __init__(self, profile: CostProfile, store: Callable[[CostProfile], None], max_rows: int, full_depth: int):
        self.base = self.written = profile
        self.store, self.full_depth = store, full_depth
        self.grid = [g for g in profile.rows if g <= max_rows] or [1]
        self._verify: dict[int, list[float]] = {}
        self._draft: dict[int, list[float]] = {}
        self._confirmed = {g for g in self.grid if g in profile.checked_rows}
        self.draft_confirmed = profile.draft_checked
        self._doubted = False  # an earlier process's confirmations dropped (see the module)
        self._mine: set[int] = set()  # the counts this process confirmed
        self._draft_mine = False
        self._rounds = 0
        self._drafted_at: int | None = None  # the latest round whose full-depth draft was kept
        self._stores, self._stored_at = 0, 0  # this process's stores, and the round of the last
        self._stale, self._refit_at = False, 0  # a smaller move not applied yet, and the round of the last refit
        self.scale = 1.0  # live ms per profile ms
        self._refresh()

    def _bucket(self, rows: int) -> int:
        """The measured count whose cost a round of `rows` rows leans on: the first at or above it."""
        return next((g for g in self.grid if g >= rows), self.grid[-1])

    def _agreed(self, kept: list[float], stored_ms: float, rows: int = 0) -> bool:
        """Whether `kept` confirms a cost: its fastest two agree within AGREE, among CONFIRM timings, or CONFIRM_DEAR
        where the fastest came out CONTRADICTS times dearer than the stored cost at the live scale, or (a verify of
        `rows` rows) dearer than that many one-row verifies could plausibly be: on a crowded machine two slowed
        rounds can agree, and a cost confirmed too dear is never timed again."""
        fastest = sorted(kept)[:2]
        if not fastest:
            return False
        one = min(self._verify[1]) if 1 in self._verify else self.base.verify_ms[0] * self.scale
        dear = fastest[0] > CONTRADICTS * stored_ms * self.scale or fastest[0] > PLAUSIBLE_PER_ROW * rows * one > 0
        return len(kept) >= (CONFIRM_DEAR if dear else CONFIRM) and fastest[-1] <= AGREE * fastest[0]

    @property
    def draft_unsure(self) -> bool:
        """Whether the draft's cost is to be timed: unconfirmed, or confirmed but not timed by this process yet or
        not for REDRAFT rounds (a draft confirmed too dear is otherwise never drafted, so never timed, again)."""
        return not self.draft_confirmed or self._drafted_at is None or self._rounds - self._drafted_at >= REDRAFT

    @property
    def hope(self) -> CostProfile:
        """The hopeful costs (see the module): a draft whose cost is to be timed counts as free."""
        return self._hope_free if self.draft_unsure else self._hope_kept

    def exploring(self) -> bool:
        """Whether the coming round is one that may explore (one in EVERY, while a count is unconfirmed or the
        draft's cost is to be timed)."""
        return self._rounds % EVERY == 1 and (len(self._confirmed) < len(self.grid) or self.draft_unsure)

    def targets(self, pick: int) -> list[int]:
        """The counts to explore beside a pick of `pick` rows: the first unconfirmed one above it and the first
        below it, the nearer (in ratio) first, the larger on a tie. Every count between the pick and either is
        confirmed, so an explored tree is at most twice the rows of a count whose cost is known or the pick."""
        left = [g for g in self.grid if g != pick and g not in self._confirmed]
        above = [g for g in left if g > pick][:1]
        below = [g for g in left if g < pick][-1:]
        return sorted(above + below, key=lambda g: (abs(math.log(g / pick)), -g))

    def observe(self, rows: int, verify_ms: float, draft_ms: float | None, depth: int | None) -> bool:
        """Count one round (`draft_ms` None: it did not draft; `depth`: its draft's offsets); whether the used
        costs changed. A time below the profile's resolution counts as that (a coarse clock's 0 is no cost to
        scale by)."""
        verify_ms = max(verify_ms, MIN_MS)
        draft_ms = None if draft_ms is None else max(draft_ms, MIN_MS)
        self._rounds += 1
        if self._rounds == 1:  # the first round in a fresh process pays for first runs
            return False
        fresh = rows not in self._verify
        moved = _keep(self._verify, rows, verify_ms)
        if fresh:  # a count timed for the first time moves nothing where the costs already say about as much
            said = self._used_ms[rows] if rows < len(self._used_ms) else float(self.used.verify_cost(rows))
            moved = _moved(said, verify_ms) if rows in self.grid or verify_ms < said else 1.0
        if draft_ms is not None and depth is not None:
            draft_moved = _keep(self._draft, depth, draft_ms)
            if depth == self.full_depth or self.base.draft_depths:  # a shallow draft's cost is used where it differs
                moved = max(moved, draft_moved)
            if depth == self.full_depth:
                self._drafted_at = self._rounds
        confirmed = rows in self.grid and rows not in self._confirmed and self._agreed(
            self._verify[rows], float(self.base.verify_cost(rows)), rows if rows > 1 else 0)
        if confirmed:
            self._confirmed.add(rows)
            self._mine.add(rows)
        if not self.draft_confirmed and self._agreed(self._draft.get(self.full_depth, []), self.base.draft_ms):
            self.draft_confirmed = self._draft_mine = confirmed = True
        self._stale = self._stale or moved > 1 + NOTICE
        due = self._rounds - self._refit_at >= REFIT_GAP
        if not (confirmed or moved >= CONTRADICTS or (self._stale and due)):
            return False
        self._stale, self._refit_at = False, self._rounds
        self._refresh()
        self._restore()
        return True

    def settle(self) -> bool:
        """Asked once a decode has ended, off its clock: a smaller move still waiting for its refit is applied, and
        what was learned is stored where it is worth a write (`_restore`), so the store holds all of it. Whether
        the used costs changed."""
        stale = self._stale
        if stale:
            self._stale, self._refit_at = False, self._rounds
            self._refresh()
        if self._verify:
            self._restore()
        return stale

    def _refresh(self) -> None:
        """`used` and `hope` from the base profile and the rounds kept so far."""
        base = self.base
        several = {r: min(v) for r, v in self._verify.items() if len(v) >= CONFIRM}
        self.scale = 1.0
        if self._verify:
            first = min(self._verify)
            self.scale = min(self._verify[first]) / float(base.verify_cost(first))
            if not self._doubted and _moved(1.0, self.scale) >= CONTRADICTS:
                self._doubt()
        prior = self._curve(several)
        once = {r: v[0] for r, v in self._verify.items() if len(v) < CONFIRM}
        between = [r for r in once if r not in self.grid]
        once.update(zip(between, np.minimum([once[r] for r in between], np.interp(between, *prior)).tolist()))
        rows, ms = self._curve({**several, **once})
        draft_ms = self._draft_used(self.full_depth, base.draft_ms * self.scale)
        depths, share = self._depth_shares(draft_ms)
        self.used = replace(base, rows=tuple(rows), verify_ms=tuple(ms), spread=(), draft_ms=draft_ms,
                            draft_depths=depths, draft_share=share)
        self._used_ms = self.used.verify_cost(np.arange(self.grid[-1] + 1)).tolist()  # by row count, for `observe`
        grid = np.array(self.grid)
        below = [max([c for c in self._confirmed if c < g], default=1) for g in self.grid]
        floor = np.interp(below, rows, ms)  # per measured count: the cost of the confirmed count below it
        bucket = np.minimum(np.searchsorted(grid, rows), len(grid) - 1)
        sure = np.isin(grid[bucket], list(self._confirmed))
        hope = np.where(sure, ms, np.minimum(ms, floor[bucket]))
        self._hope_free = replace(self.used, verify_ms=tuple(hope.tolist()), draft_ms=0.0)
        self._hope_kept = replace(self._hope_free, draft_ms=draft_ms)

    def _draft_used(self, depth: int, stored_ms: float) -> float:
        """A draft's used cost at `depth`: its fastest where timed in CONFIRM rounds, else no more than stored."""
        drafts = self._draft.get(depth, [])
        return min(drafts) if len(drafts) >= CONFIRM else min(drafts + [stored_ms])

    def _depth_shares(self, draft_ms: float) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The used draft cost by depth, as shares of the full draft's `draft_ms`: the stored profile's, and a depth
        this process drafted at its own cost (as `_draft_used` takes it). None where the profile has no depths."""
        base = self.base
        if not base.draft_depths:
            return (), ()
        shares = dict(zip(base.draft_depths, base.draft_share))
        shares[self.full_depth] = 1.0
        for depth in self._draft:
            if depth < self.full_depth:
                ms = self._draft_used(depth, base.draft_cost(depth) * self.scale)
                shares[depth] = min(max(ms / draft_ms, MIN_MS), 1.0)
        depths = sorted(d for d in shares if d <= self.full_depth)
        return tuple(depths), tuple(shares[d] for d in depths)

    def _doubt(self) -> None:
        """Drop the confirmations an earlier process stored (this process's own stay): they were timed on
        another scale than this process's rounds come out on."""
        self._doubted = True
        self._confirmed = set(self._mine)
        self.draft_confirmed = self._draft_mine

    def _curve(self, seen: dict[int, float]) -> tuple[list[int], list[float]]:
        """Rows and monotone ms through the observed `seen` and the base profile's counts not observed (see the
        module: scaled as the nearest observed count below, or at its cost where that came out much cheaper)."""
        base = self.base
        keys = sorted(set(seen) | set(base.rows))
        stored = dict(zip(keys, base.verify_cost(np.array(keys)).tolist()))
        points = dict(seen)
        timed = sorted(seen)
        for g in base.rows:
            if g in seen:
                continue
            at = bisect.bisect_left(timed, g)
            if not at:
                points[g] = stored[g] * self.scale
                continue
            near = timed[at - 1]
            ratio = seen[near] / stored[near]
            points[g] = seen[near] if ratio * CONTRADICTS < self.scale else stored[g] * ratio
        rows = sorted(points)
        ms = np.minimum.accumulate(np.array([points[r] for r in rows])[::-1])[::-1]
        return rows, ms.tolist()

    def _restore(self) -> None:
        """Store the used costs at the profile's scale where they moved by more than RESTORE or a count was
        newly confirmed."""
        if self._stores >= FREE_STORES and self._rounds - self._stored_at < STORE_GAP:
            return
        written, grid = self.written, np.array(self.base.rows)
        checked = tuple(sorted((set() if self._doubted else set(written.checked_rows)) | self._confirmed))
        learned = np.maximum(self.used.verify_cost(grid) / self.scale, MIN_MS)
        draft = max(self.used.draft_ms / self.scale, MIN_MS)
        before = np.append(written.verify_cost(grid), written.draft_ms)
        now = np.append(learned, draft)
        if (checked, self.draft_confirmed) == (written.checked_rows, written.draft_checked) and np.all(
                np.maximum(now / before, before / now) <= RESTORE):
            return
        settled = all(g in checked for g in self.grid if g > min(self._verify))
        self.written = replace(written, verify_ms=tuple(kept_ms(v) for v in learned), draft_ms=kept_ms(draft),
                               checked_rows=checked, draft_checked=self.draft_confirmed,
                               provisional=written.provisional and not settled)
        self._stores, self._stored_at = self._stores + 1, self._rounds
        self.store(self.written)
