"""A cost profile (`cost-profile-<device>.json`, beside the artifacts or engines or in the cache): what a round
costs on one device, as `glance_runtime.decode.cost_profile` measures it and `--budget auto` weighs it.

Document (format_version 3): format, format_version, device (backend, provider, threads, processor or GPU),
rows (verify row counts measured, ascending from 1), verify_ms (the least disturbed ms of each: the fastest of
its repeats), draft_ms (likewise, a draft pass of the full depth and its tree), draft_depths and draft_share
(draft depths timed, ascending to the full one, and each one's cost as a share of draft_ms, so 1 at the full
depth: a graph that drafts short blocks runs its head over fewer rows for a shallow draft; empty for a head that
drafts a depth a pass), repeats, measured_at; how it was
measured:
spread (per row count, how far the median repeat lay above the fastest, as a fraction of it), load_average
(the 1-minute load average when measured, null where unreadable), provisional (measured under doubt: large
spread, not monotone or implausible, so decoding refines it rather than trusting it); and checked_rows (row
counts whose costs the decode's own rounds have confirmed or set) and draft_checked (the draft's, likewise).
Version 1 documents (medians; no spread, load, provisional or draft_checked) are still read: as measured on a
machine of unknown load, not provisional; version 1 and 2 documents (no draft depths) as drafts costing the same
at every depth (`cost_profile.stored_or_measured` measures such a profile again where the draft has depths). A profile that cannot be read is measured again
(`cost_profile.load`), so `read` refuses anything else in one line and the caller decides.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..store.atomic import write_file
from ..errors import GlanceError
from .common import Invalid, dumps, guarded, read_json, stamped

FORMAT = "glance-cost"
VERSION = 3
READS = (1, 2, 3)  # versions `read` accepts: version 1 lacks the measurement's spread, load and provisional
# flag, versions 1 and 2 the draft's cost by depth
WHAT = "GLANCE cost profile"
FIX = "delete it to have it measured again (or run `glance-bench cost --remeasure`)"
MAX_ROWS = 1 << 16
PLAUSIBLE_PER_ROW = 1.5  # an n-row verify costing more than this many times n one-row verifies is a noisy timing
LARGE_SPREAD = 0.5  # repeats whose median lies this far above their fastest were timed on a busy machine
MONOTONE_SLACK = 1.1  # a larger tree timed cheaper than a smaller one by more than this is noise, not the device
REMEDY = ("fix: run `glance-bench cost --remeasure` on a quiet machine (decoding meanwhile re-times the row "
          "counts auto uses)")


@dataclass(frozen=True)
class CostProfile:
    device: str  # what it was measured on: backend, provider, threads, processor or GPU
    rows: tuple[int, ...]  # verify rows measured, ascending, starting at 1
    verify_ms: tuple[float, ...]  # verify-side ms of a round with that many rows
    draft_ms: float  # ms of a draft pass and the tree built from it
    repeats: int
    measured_at: str
    checked_rows: tuple[int, ...] = ()  # row counts the decode's own rounds have confirmed or set
    draft_checked: bool = False  # whether they have confirmed or set the draft's cost
    spread: tuple[float, ...] = ()  # per row count: (median - fastest) / fastest of its repeats; () unknown
    load_average: float | None = None  # 1-minute load average while measured; None where unknown
    provisional: bool = False  # measured under doubt: decoding refines it rather than taking it as fact
    draft_depths: tuple[int, ...] = ()  # draft depths timed, ascending, the last the full one (empty: one cost)
    draft_share: tuple[float, ...] = ()  # each one's ms as a share of draft_ms (the full depth's, 1)

    def draft_cost(self, depth: int | None) -> float:
        """ms of a draft `depth` offsets deep and its tree (None: the full depth): linear between the depths timed,
        never more than a deeper one (a longer block does a shorter one's work and more)."""
        if depth is None or not self.draft_depths:
            return self.draft_ms
        share = np.minimum.accumulate(np.asarray(self.draft_share, dtype=float)[::-1])[::-1]
        return float(self.draft_ms * np.interp(depth, self.draft_depths, share))

    def monotone_ms(self) -> np.ndarray:
        """verify_ms made non-decreasing by the running minimum from above: a tree never costs less than one of
        its prefixes, and other processes only ever add time, so of two inconsistent timings the cheaper is
        the likelier; a noisy row count is thereby never thought dearer than a larger one."""
        cost = np.asarray(self.verify_ms, dtype=float)
        return np.minimum.accumulate(cost[::-1])[::-1]

    def verify_cost(self, rows: np.ndarray | int) -> np.ndarray:
        """ms of a round's verify side for `rows` rows: linear between measured counts (made monotone, see
        `monotone_ms`), extended past the last at its last slope."""
        grid = np.asarray(self.rows, dtype=float)
        cost = self.monotone_ms()
        rows_f = np.asarray(rows, dtype=float)
        inside = np.interp(rows_f, grid, cost)
        if len(grid) < 2:
            return inside
        slope = max((cost[-1] - cost[-2]) / (grid[-1] - grid[-2]), 0.0)
        return np.where(rows_f > grid[-1], cost[-1] + slope * (rows_f - grid[-1]), inside)

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    def plausible_ms(self, rows: int) -> float:
        """The most an honest `rows`-row verify can cost: a one-packed-pass can be slower per row than a single
        row, but not by much; several single-row passes would do the same work."""
        return PLAUSIBLE_PER_ROW * rows * self.verify_ms[0]

    def doubts(self) -> list[str]:
        """Why these costs are implausible (empty: plausible), one line per row count."""
        one = self.verify_ms[0]
        return [f"a {r}-row verify timed at {ms / one:.1f}x one row, more than {PLAUSIBLE_PER_ROW:g} x {r} rows' worth"
                for r, ms in zip(self.rows[1:], self.verify_ms[1:]) if ms > self.plausible_ms(r)]

    def disorder(self) -> list[str]:
        """Where a larger tree was timed cheaper than a smaller one (beyond MONOTONE_SLACK): noise, one line each."""
        dearest = [max(self.verify_ms[:i + 1]) for i in range(len(self.rows))]
        return [f"{r} rows timed at {ms:.2f} ms, cheaper than {self.rows[self.verify_ms.index(before)]} rows' "
                f"{before:.2f} ms" for r, ms, before in zip(self.rows[1:], self.verify_ms[1:], dearest)
                if ms * MONOTONE_SLACK < before]

    def wide(self) -> list[str]:
        """The row counts whose repeats spread more than LARGE_SPREAD (a busy machine while measuring), one line."""
        wide = [f"{r} rows {s:.0%}" for r, s in zip(self.rows, self.spread) if s > LARGE_SPREAD]
        load = "" if self.load_average is None else f", load average {self.load_average:.2f}"
        return [f"repeats spread widely above their fastest ({', '.join(wide)}{load})"] if wide else []

    def problems(self) -> list[str]:
        """Everything that makes these costs doubtful, one line each (empty: a profile to take as measured)."""
        lines = self.doubts() + self.disorder() + self.wide()
        if self.provisional and not lines:
            lines.append("measured under doubt (provisional): decoding refines it from its own rounds")
        return lines

    def as_dict(self) -> dict:
        return stamped(asdict(self), FORMAT, VERSION)

    @classmethod
    def from_dict(cls, raw: dict) -> "CostProfile":
        """The profile a document holds; ValueError (Invalid) naming the first field that is not a cost."""
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("format_version") not in READS:
            raise Invalid(f"not a {FORMAT} v{VERSION} file")
        try:
            rows, verify = raw["rows"], raw["verify_ms"]
            if not isinstance(rows, (list, tuple)) or not isinstance(verify, (list, tuple)) or \
                    any(type(r) is not int or not 1 <= r <= MAX_ROWS for r in rows):
                raise Invalid("rows must be a list of row counts")
            if not rows or rows[0] != 1 or len(rows) != len(verify) or list(rows) != sorted(set(rows)):
                raise Invalid("rows must ascend from 1, one verify time each")
            costs = [*verify, raw["draft_ms"]]
            if any(type(v) not in (int, float) or not math.isfinite(v) or v <= 0 for v in costs):
                raise Invalid("costs must be positive")
            if type(raw["repeats"]) is not int or raw["repeats"] < 1:
                raise Invalid("repeats must be a positive integer")
            if not isinstance(raw["device"], str) or not isinstance(raw["measured_at"], str):
                raise Invalid("device and measured_at must be strings")
            checked = raw.get("checked_rows", [])
            if not isinstance(checked, (list, tuple)) or any(type(r) is not int or not 1 <= r <= MAX_ROWS
                                                             for r in checked):
                raise Invalid("checked_rows must be a list of row counts")
            spread = raw.get("spread", [])
            if not isinstance(spread, (list, tuple)) or len(spread) not in (0, len(rows)) or any(
                    type(s) not in (int, float) or not math.isfinite(s) or s < 0 for s in spread):
                raise Invalid("spread must be a non-negative number per row count")
            load = raw.get("load_average")
            if load is not None and (type(load) not in (int, float) or not math.isfinite(load) or load < 0):
                raise Invalid("load_average must be a non-negative number or null")
            depths, share = raw.get("draft_depths", []), raw.get("draft_share", [])
            if not isinstance(depths, (list, tuple)) or not isinstance(share, (list, tuple)) or len(depths) != len(
                    share) or any(type(d) is not int or not 1 <= d <= MAX_ROWS for d in depths) or list(
                    depths) != sorted(set(depths)):
                raise Invalid("draft_depths must ascend, one draft_share each")
            if any(type(v) not in (int, float) or not math.isfinite(v) or not 0 < v <= 1 for v in share) or (
                    share and share[-1] != 1):
                raise Invalid("draft_share must be fractions of the full draft's cost, ending at 1")
            provisional, draft_checked = raw.get("provisional", False), raw.get("draft_checked", False)
            if type(provisional) is not bool or type(draft_checked) is not bool:
                raise Invalid("provisional and draft_checked must be true or false")
        except KeyError as exc:
            raise Invalid(f"{exc.args[0]} is missing") from None
        return cls(device=raw["device"], rows=tuple(rows), verify_ms=tuple(float(v) for v in verify),
                   draft_ms=float(raw["draft_ms"]), repeats=raw["repeats"], measured_at=raw["measured_at"],
                   checked_rows=tuple(sorted(set(checked))), draft_checked=draft_checked,
                   spread=tuple(float(s) for s in spread),
                   load_average=None if load is None else float(load), provisional=provisional,
                   draft_depths=tuple(depths), draft_share=tuple(float(v) for v in share))

    def table(self) -> str:
        """The profile as a few readable lines (what `glance-bench cost` prints)."""
        load = "load average unknown" if self.load_average is None else f"load average {self.load_average:.2f}"
        how = "median" if not self.spread else "fastest"
        by_depth = "" if not self.draft_depths else " (ms by depth: " + ", ".join(
            f"{d}: {self.draft_cost(d):.2f}" for d in self.draft_depths) + ")"
        lines = [f"measured on: {self.device} ({self.measured_at}, {how} of {self.repeats} rounds each, {load}"
                 f"{', provisional' if self.provisional else ''})",
                 f"draft pass + tree: {self.draft_ms:.2f} ms{by_depth}",
                 "verify rows    ms   ms/row  x one row" + ("  spread" if self.spread else "")]
        one = self.verify_ms[0]
        spread = [f" {s:>6.0%}" for s in self.spread] or [""] * len(self.rows)
        lines += [f"{r:>11} {ms:>6.2f} {ms / r:>7.3f} {ms / one:>9.2f}{s}"
                  for r, ms, s in zip(self.rows, self.verify_ms, spread)]
        if self.checked_rows or self.draft_checked:
            checked = [f"{', '.join(map(str, self.checked_rows))} rows"] if self.checked_rows else []
            lines.append(f"checked against decoding: {', '.join(checked + ['the draft'] * self.draft_checked)}")
        return "\n".join(lines)


def read(path: Path) -> CostProfile:
    raw = read_json(path, WHAT, FIX)
    found, version = raw.get("format"), raw.get("format_version")
    if found != FORMAT or version not in READS:
        raise GlanceError(f"{path} is not a {WHAT} this toolkit reads (format {found!r} v{version!r}, it reads "
                          f"{FORMAT} v{READS[0]}-v{READS[-1]}); {FIX}")
    return guarded(path, FIX, lambda: CostProfile.from_dict(raw))


def write(path: Path, profile: CostProfile) -> None:
    try:
        write_file(path, dumps(profile.as_dict()))
    except OSError as exc:
        raise GlanceError(f"cannot write the cost profile {path} ({exc.strerror}); set GLANCE_CACHE to a "
                          "writable directory") from None
