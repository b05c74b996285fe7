"""The law applied to a round log: one mode's rounds, each prompt counted once, per kind and pooled.

Kept samples of one prompt repeat the same rounds (decoding is deterministic), so only each
prompt's first kept sample enters the fit; otherwise repeats would shrink the intervals for free.
An answer's final round is left out by default: its acceptance is cut short by the answer's end
(drafts past the stop token, or past max tokens), not by the target's uncertainty, and on short
answers such rounds are a large share of all rounds.
"""
from __future__ import annotations

from ..errors import GlanceError
from .law import LawFit, analyse

POOLED = "pooled"


def default_mode(rows: list[dict]) -> str | None:
    """The largest tree budget in the log (the paper's setting is its largest tree), else any mode."""
    modes = {row.get("mode") for row in rows}
    trees = [m for m in modes if isinstance(m, str) and m.startswith("tree-")]
    if trees:
        return max(trees, key=lambda m: int(m.split("-")[1]))
    spec = sorted(m for m in modes if isinstance(m, str) and m != "ar")
    return spec[0] if spec else None


def select(rows: list[dict], mode: str | None, cap: int | None, include_final: bool = False) -> list[dict]:
    """Rows of `mode` (all rows in a log without modes), first kept sample per prompt, final rounds
    dropped unless `include_final` (logs without the field keep every round), cap filled in."""
    if any("mode" in row for row in rows):
        mode = mode or default_mode(rows)
        modes = sorted({str(row.get("mode")) for row in rows})
        if mode not in modes:
            raise GlanceError(f"mode {mode!r} is not in the round log; it has: {', '.join(modes)}")
        rows = [row for row in rows if row.get("mode") == mode]
    first: dict[tuple, int] = {}
    for row in rows:
        key = (row.get("kind"), row.get("prompt"))
        first[key] = min(first.get(key, row.get("sample", 0)), row.get("sample", 0))
    rows = [row for row in rows if row.get("sample", 0) == first[(row.get("kind"), row.get("prompt"))]]
    if not include_final:
        rows = [row for row in rows if not row.get("final", False)]
    out = []
    for row in rows:
        row_cap = row.get("cap", cap)
        if row_cap is None:
            raise GlanceError("the round log has no \"cap\" field; pass --cap (B - 1, e.g. 15)")
        out.append({**row, "cap": int(row_cap), "drafted": int(row["accepted"]) - 1})
    return out


def fit_log(rows: list[dict], mode: str | None = None, cap: int | None = None, replicates: int = 500,
            seed: int = 0, include_final: bool = False) -> dict[str, LawFit]:
    """LawFit per kind (where the log names kinds) and pooled."""
    rows = select(rows, mode, cap, include_final)
    bad = [r for r in rows if not 0 <= r["drafted"] <= r["cap"]]
    if bad:
        raise GlanceError(f"a round accepted {bad[0]['accepted']} tokens with a cap of {bad[0]['cap']} drafted ones; "
                          "is --cap right?")
    groups = {}
    for row in rows:
        groups.setdefault(str(row.get("kind", POOLED)), []).append(row)
    sets = dict(sorted(groups.items())) if len(groups) > 1 else {}
    sets[POOLED] = rows
    return {name: analyse([r["entropy"] for r in rs], [r["drafted"] for r in rs], [r["cap"] for r in rs],
                          groups=[(r.get("kind"), r.get("prompt"), r.get("sample")) if "prompt" in r else i
                                  for i, r in enumerate(rs)], replicates=replicates, seed=seed)
            for name, rs in sets.items()}
