"""The decode's own round timings, held against the cost profile `--budget auto` weighs, which they correct.

A profile is measured once per device and stored. One noisy moment while it was measured (another process
busy on the same cores) can make trees look several times dearer than they are, and a profile that says
drafting never pays would never be contradicted by a decode that therefore never drafts. So:
- every round's verify-side time (mask, verify, walk, commit) is kept per measured row count (a round of
  rows between two is counted at the one below, scaled along the profile), and a drafted round's draft time
  too (the last WINDOW of each; the very first round is a warm-up in a fresh process and is not kept);
- auto's choices depend only on how costs compare, not on their scale (a machine uniformly slower now than
  when it was measured needs no new profile), so rounds are compared by shape: once two row counts (or one
  and the draft) have MIN_SEEN rounds, their fastest rounds (other processes only ever add time, so the
  fastest is the least disturbed), relative to the smallest such count's, are held against the profile's;
  off by more than `CONTRADICTS` either way, the profile is corrected to the observed shape at its own scale
  (`CostProfile.corrected`), the policy takes it at once, and it is stored;
- while the profile's smallest tree (the anchor and one node, PROBE_ROWS) is unchecked, every other round
  that would verify the anchor alone drafts and verifies the anchor and the best node instead (a probe: the
  tokens are greedy's all the same), so plain steps and probes are timed side by side and a profile that
  says drafting never pays is tried within a few rounds. Once CONFIRM probes and plain steps bear it out, it
  is stored as checked and later runs do not probe; fewer leave it to the next run to try again.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Callable

from ..formats.cost import CostProfile

PROBE_ROWS = 2
MIN_SEEN = 3  # rounds of one kind before they may contradict the profile
CONFIRM = 5  # probes and plain steps before they may confirm it (noise makes a small sample look either way)
WINDOW = 9  # the latest rounds of one kind that count


class CostWatch:
    """One decoding process's view of how its rounds cost against `profile`; `store` saves a changed profile."""

    def __init__(self, profile: CostProfile, store: Callable[[CostProfile], None]):
        self.profile, self.store = profile, store
        self._verify: dict[int, list[float]] = defaultdict(list)
        self._draft: list[float] = []
        self._rounds: dict[int, int] = defaultdict(int)  # rounds seen per measured row count
        self._warm = False

    def probing(self) -> bool:
        """Whether a round that would verify the anchor alone should verify PROBE_ROWS rows instead: every other
        such round, until CONFIRM probes are kept."""
        if self.profile.max_rows < PROBE_ROWS or PROBE_ROWS in self.profile.checked_rows:
            return False
        probes, plain = self._rounds[PROBE_ROWS], self._rounds[1]
        return len(self._verify[PROBE_ROWS]) < CONFIRM and probes <= plain

    def _keep(self, kind: int | str, value: float) -> None:
        kept = self._draft if kind == "draft" else self._verify[kind]
        kept.append(value)
        del kept[:-WINDOW]

    def observe(self, rows: int, verify_ms: float, draft_ms: float | None) -> CostProfile | None:
        """Count one round (`draft_ms` None: it did not draft); the profile, changed and stored, where these
        rounds contradict its shape or have just checked its probe size; else None."""
        profile = self.profile
        measured = max(r for r in profile.rows if r <= rows)
        self._rounds[measured] += 1
        if not self._warm:  # the first round in a fresh process pays for first runs
            self._warm = True
            return None
        self._keep(measured, verify_ms * float(profile.verify_cost(measured)) / float(profile.verify_cost(rows)))
        if draft_ms is not None:
            self._keep("draft", draft_ms)
        sizes = sorted(r for r, v in self._verify.items() if len(v) >= MIN_SEEN)
        if not sizes:
            return None
        scale = float(profile.verify_cost(sizes[0])) / min(self._verify[sizes[0]])
        verify = {r: min(self._verify[r]) * scale for r in sizes}
        draft = min(self._draft) * scale if len(self._draft) >= MIN_SEEN else None
        confirmed = min(len(self._verify[1]), len(self._verify[PROBE_ROWS])) >= CONFIRM
        if profile.contradicted_by(verify, draft):
            profile = profile.corrected(verify, draft, time.strftime("%Y-%m-%dT%H:%M:%S"))
        elif confirmed and PROBE_ROWS not in profile.checked_rows:
            profile = replace(profile, checked_rows=tuple(sorted({*profile.checked_rows, 1, PROBE_ROWS})))
        else:
            return None
        self.profile = profile
        self.store(profile)
        return profile
