"""A cost profile (`cost-profile-<device>.json`, beside the artifacts or engines or in the cache): what a round
costs on one device, as `glance_runtime.decode.cost_profile` measures it and `--budget auto` weighs it.

Document (format_version 1): format, format_version, device (backend, provider, threads, processor or GPU),
rows (verify row counts measured, ascending from 1), verify_ms (the median ms of each), draft_ms (the median
ms of a draft pass and its tree), repeats, measured_at, and, optionally, checked_rows (row counts whose costs
the decode's own round timings have borne out; absent in profiles written before it). A profile
that cannot be read is measured again (`cost_profile.load`), so `read` refuses anything else in one line and
the caller decides.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ..store.atomic import write_file
from ..errors import GlanceError
from .common import Invalid, check_header, dumps, guarded, read_json, stamped

FORMAT = "glance-cost"
VERSION = 1
WHAT = "GLANCE cost profile"
FIX = "delete it to have it measured again (or run `glance-bench cost`)"
MAX_ROWS = 1 << 16
PLAUSIBLE_PER_ROW = 1.5  # an n-row verify costing more than this many times n one-row verifies is a noisy timing
CONTRADICTS = 2.0  # how far off (either way) an observed cost must be to correct a profile


@dataclass(frozen=True)
class CostProfile:
    device: str  # what it was measured on: backend, provider, threads, processor or GPU
    rows: tuple[int, ...]  # verify rows measured, ascending, starting at 1
    verify_ms: tuple[float, ...]  # median verify-side ms of a round with that many rows
    draft_ms: float  # median ms of a draft pass and the tree built from it
    repeats: int
    measured_at: str
    checked_rows: tuple[int, ...] = ()  # row counts the decode's own timings have borne out

    def verify_cost(self, rows: np.ndarray | int) -> np.ndarray:
        """ms of a round's verify side for `rows` rows: linear between measured counts (made non-decreasing,
        so timing noise never makes a bigger tree look cheaper), extended past the last at its last slope."""
        grid = np.asarray(self.rows, dtype=float)
        cost = np.maximum.accumulate(np.asarray(self.verify_ms, dtype=float))
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

    def corrected(self, verify: dict[int, float], draft_ms: float | None, at: str) -> "CostProfile":
        """These costs corrected by observed ones (`verify`: ms by row count; `draft_ms`: None keeps the draft's).
        Observed counts take their observed ms and are interpolated between; measured counts below them stay;
        above them, a measured count is scaled as the largest observed one was, unless that one came out
        cheaper than measured by more than `CONTRADICTS`: then the measurement's growth above it is suspect too
        and they cost what it does. Erring cheap is safe: a tree that costs more than thought is drafted,
        timed and corrected; one thought too dear would never be tried."""
        observed = sorted(verify)
        points = dict(verify)
        points.update((r, ms) for r, ms in zip(self.rows, self.verify_ms) if not observed or r < observed[0])
        if observed:
            last = observed[-1]
            ratio = verify[last] / float(self.verify_cost(last))
            points.update((r, ms * ratio if ratio * CONTRADICTS >= 1 else verify[last])
                          for r, ms in zip(self.rows, self.verify_ms) if r > last)
        rows = tuple(sorted(points))
        return replace(self, rows=rows, verify_ms=tuple(round(points[r], 4) for r in rows),
                       draft_ms=round(draft_ms, 4) if draft_ms is not None else self.draft_ms, measured_at=at)

    def contradicted_by(self, verify: dict[int, float], draft_ms: float | None) -> bool:
        """Whether observed costs (as `corrected` takes them) are off these by more than CONTRADICTS either way."""
        pairs = [(ms, float(self.verify_cost(r))) for r, ms in verify.items()]
        pairs += [(draft_ms, self.draft_ms)] if draft_ms is not None else []
        return any(not expected / CONTRADICTS <= seen <= expected * CONTRADICTS for seen, expected in pairs)

    def as_dict(self) -> dict:
        return stamped(asdict(self), FORMAT, VERSION)

    @classmethod
    def from_dict(cls, raw: dict) -> "CostProfile":
        """The profile a document holds; ValueError (Invalid) naming the first field that is not a cost."""
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("format_version") != VERSION:
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
        except KeyError as exc:
            raise Invalid(f"{exc.args[0]} is missing") from None
        return cls(device=raw["device"], rows=tuple(rows), verify_ms=tuple(float(v) for v in verify),
                   draft_ms=float(raw["draft_ms"]), repeats=raw["repeats"], measured_at=raw["measured_at"],
                   checked_rows=tuple(sorted(set(checked))))

    def table(self) -> str:
        """The profile as a few readable lines (what `glance-bench cost` prints)."""
        lines = [f"measured on: {self.device} ({self.measured_at}, median of {self.repeats} rounds each)",
                 f"draft pass + tree: {self.draft_ms:.2f} ms",
                 "verify rows    ms   ms/row  x one row"]
        one = self.verify_ms[0]
        lines += [f"{r:>11} {ms:>6.2f} {ms / r:>7.3f} {ms / one:>9.2f}" for r, ms in zip(self.rows, self.verify_ms)]
        if self.checked_rows:
            lines.append(f"checked against decoding at {', '.join(map(str, self.checked_rows))} rows")
        return "\n".join(lines)


def read(path: Path) -> CostProfile:
    raw = read_json(path, WHAT, FIX)
    check_header(raw, path, WHAT, FORMAT, VERSION, FIX)
    return guarded(path, FIX, lambda: CostProfile.from_dict(raw))


def write(path: Path, profile: CostProfile) -> None:
    try:
        write_file(path, dumps(profile.as_dict()))
    except OSError as exc:
        raise GlanceError(f"cannot write the cost profile {path} ({exc.strerror}); set GLANCE_CACHE to a "
                          "writable directory") from None
