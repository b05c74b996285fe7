"""A cost profile (`cost-profile-<device>.json`, beside the artifacts or engines or in the cache): what a round
costs on one device, as `glance_runtime.decode.cost_profile` measures it and `--budget auto` weighs it.

Document (format_version 1): format, format_version, device (backend, provider, threads, processor or GPU),
rows (verify row counts measured, ascending from 1), verify_ms (the median ms of each), draft_ms (the median
ms of a draft pass and its tree), repeats, measured_at. A profile that cannot be read is measured again
(`cost_profile.load`), so `read` refuses anything else in one line and the caller decides.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class CostProfile:
    device: str  # what it was measured on: backend, provider, threads, processor or GPU
    rows: tuple[int, ...]  # verify rows measured, ascending, starting at 1
    verify_ms: tuple[float, ...]  # median verify-side ms of a round with that many rows
    draft_ms: float  # median ms of a draft pass and the tree built from it
    repeats: int
    measured_at: str

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
        except KeyError as exc:
            raise Invalid(f"{exc.args[0]} is missing") from None
        return cls(device=raw["device"], rows=tuple(rows), verify_ms=tuple(float(v) for v in verify),
                   draft_ms=float(raw["draft_ms"]), repeats=raw["repeats"], measured_at=raw["measured_at"])

    def table(self) -> str:
        """The profile as a few readable lines (what `glance-bench cost` prints)."""
        lines = [f"measured on: {self.device} ({self.measured_at}, median of {self.repeats} rounds each)",
                 f"draft pass + tree: {self.draft_ms:.2f} ms",
                 "verify rows    ms   ms/row  x one row"]
        one = self.verify_ms[0]
        lines += [f"{r:>11} {ms:>6.2f} {ms / r:>7.3f} {ms / one:>9.2f}" for r, ms in zip(self.rows, self.verify_ms)]
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
