"""`--budget auto` policies that force what parity under auto must cover, on any backend and model.

A measured profile and the shipped calibration would mostly draft and keep whole trees on these tiny
models, leaving skipped drafts and small cuts unexercised. These policies make both happen on purpose,
splitting rounds at the model's own median anchor surprisal, on the scale of that median (so about half
the rounds fall on each side, whatever the family, and whether the model is unsure or nearly certain):
- `skipping`: a sharp law (p near 1 below the split, near 0 above) with a draft that costs as much as a
  verify pass, so rounds above the split are plain greedy steps and rounds below draft a whole tree;
- `cutting`: no law (every round drafts) on a device where each row costs a quarter of the first, with
  node probabilities that fall as surprisal rises, so the cut ranges from every node down to none.
`check_mixed` fails a run that did not actually do what its policy was built to force.
"""
from __future__ import annotations

import numpy as np

from glance_runtime.decode.auto_budget import AutoBudget
from glance_runtime.decode.calibration import Calibration
from glance_runtime.decode.cost_profile import CostProfile, row_grid
from glance_runtime.decode.loop import DecodeConfig, DecodeResult, decode

GRID = tuple(row_grid(64))
SHARP = 12.0  # logistic slope per split of surprisal: p is 0.9 at 0.82 of the split and 0.1 at 1.18 of it


def _profile(verify_ms: list[float], draft_ms: float) -> CostProfile:
    return CostProfile(device="constructed for the parity tests", rows=GRID, verify_ms=tuple(verify_ms),
                       draft_ms=draft_ms, repeats=1, measured_at="2026-01-01T00:00:00")


FLAT = _profile([1.0 + 0.001 * r for r in GRID], draft_ms=1.0)  # a GPU-like verify, a draft as dear as a verify
STEEP = _profile([0.75 + 0.25 * r for r in GRID], draft_ms=0.5)  # a CPU-like verify: a quarter of a row per row


def median_surprisal(backend, prompt, max_new_tokens: int) -> float:
    """The median anchor surprisal of a plain greedy decode: where the policies split rounds."""
    rounds = decode(backend, prompt, DecodeConfig(max_new_tokens=max_new_tokens, speculative=False)).rounds
    split = float(np.median([r.surprisal for r in rounds if r.surprisal is not None]))
    assert split > 0, "half the anchors are certain: nothing to split rounds at"
    return split


def skipping(split: float, block_size: int, cost: CostProfile = FLAT, max_nodes: int = 63) -> AutoBudget:
    """Skips the draft above the split, drafts (and keeps most of the tree) below it."""
    return AutoBudget(cost, Calibration(law=(SHARP, SHARP / split)), max_nodes, block_size)


def cutting(split: float, block_size: int, max_nodes: int = 63) -> AutoBudget:
    """Always drafts; keeps many nodes well below the split, none well above it."""
    return AutoBudget(STEEP, Calibration(a=8.0, b=1.0, c=-8.0 / split), max_nodes, block_size)


def config(policy: AutoBudget, max_new_tokens: int, branch_k: int = 8) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=max_new_tokens, budget=policy.max_nodes, branch_k=branch_k, auto=policy)


def check_mixed(result: DecodeResult, policy: str, seeded: bool) -> None:
    """The run did what its policy forces: skipped and drafted rounds (`skipping`), or cuts of several sizes
    (`cutting`; with the random head, some of none). With seeded drafts, which accept several tokens a round
    and so visit fewer anchors, every round that verified a node must have accepted past the anchor."""
    rounds = result.rounds[:-1]  # the last round may be cut short by max_new_tokens
    drafted = [r for r in rounds if r.drafted]
    assert all(r.tree_size == 1 and r.accepted == 1 for r in rounds if not r.drafted)
    if policy == "skipping":
        assert len(drafted) < len(rounds), "no round skipped the draft"
        assert any(r.drafted for r in rounds[1:]), "no round after the first drafted"
    else:
        assert len(drafted) == len(rounds), "a round without a law skipped the draft"
        sizes = {r.tree_size for r in drafted}
        forced = len(sizes) >= 2 if seeded else (1 in sizes and len(sizes) >= 3)
        assert forced, f"cuts of {sorted(sizes)} rows only"
    if seeded:
        assert all(r.accepted >= 2 for r in drafted if r.tree_size > 1), [(r.tree_size, r.accepted) for r in rounds]
        assert max(r.accepted for r in rounds) > 2
